"""The decoding loop: settings and the ``Decoder`` (``decode``), the run skeleton every step kind
shares (``run``), the readable step (``decode.ReadableRun``) and the fixed-shape one (``fixed_step``),
the drafter's pass (``draft_pass``), and loading a target + drafter pair (``loading``). What a run
measures lives in ``engine.measure``. See ARCHITECTURE.md."""
