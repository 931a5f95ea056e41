"""GPU fast paths and measurement: Triton kernels (``beam_kernel``, ``kv_moves``, both on
``triton_support``), CUDA graphs recorded once and replayed (``graphs``), and CUDA kernels per decoding
stage (``profiling``)."""
