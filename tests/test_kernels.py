"""engine.gpu.profiling: kernels go to the stage their start falls in, counted and timed per verify step."""

from __future__ import annotations

from engine.gpu.profiling import NAME_CHARS, KernelEvent, attribute


def test_kernels_are_counted_and_timed_per_step_in_the_stage_they_start_in():
    stages = [("draft", 0, 10), ("verify", 10, 30), ("draft", 40, 50), ("verify", 50, 70)]
    kernels = [KernelEvent("gemm", 1, 4), KernelEvent("attention", 12, 6), KernelEvent("gemm", 15, 9),
               KernelEvent("softmax", 29.5, 1), KernelEvent("copy_between_steps", 35, 100),
               KernelEvent("gemm", 41, 2), KernelEvent("attention", 52, 8), KernelEvent("gemm", 60, 7)]
    profile = attribute(stages, kernels, steps=2)
    assert profile.counts == {"draft": 1.0, "verify": 2.5}, "a kernel between the stages is no stage's"
    assert profile.slowest["verify"] == [("gemm", 8.0), ("attention", 7.0), ("softmax", 0.5)]
    assert profile.slowest["draft"] == [("gemm", 3.0)]


def test_only_the_slowest_few_are_named_and_long_names_are_cut():
    long = "void cutlass::Kernel<" + "x" * 200 + ">"
    kernels = [KernelEvent(f"k{i}", i, float(i)) for i in range(1, 9)] + [KernelEvent(long, 9, 100.0)]
    profile = attribute([("verify", 0, 10)], kernels, steps=1, slowest=3)
    assert profile.slowest["verify"] == [(long[:NAME_CHARS], 100.0), ("k8", 8.0), ("k7", 7.0)]
    assert profile.counts == {"verify": 9.0}
