"""The decoding loop: settings and the ``Decoder`` (``decode``), the run skeleton every step kind
shares (``run``), the readable step (``decode.ReadableRun``) and the fixed-shape one (``fixed_step``),
the drafter's pass (``draft_pass``), loading a target + drafter pair (``loading``), and what a step
costs against what it accepts (``economics``, ``calibration``). See ARCHITECTURE.md."""
