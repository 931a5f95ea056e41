"""What a run measures and what follows from it: a step's economics (``economics``), the start-up choice
of the DDTree budget (``calibration``), a drafter's proposals replayed along a greedy output
(``acceptance``), whether a verify pass scores each row as AR's step does (``row_check``), speed-up at a
real model's shape (``projection``), and the drafter doctor (``doctor`` over ``doctor_checks``). These run
the loop and the models; the loop never imports them. See ARCHITECTURE.md."""
