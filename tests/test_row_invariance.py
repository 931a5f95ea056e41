"""``engine.measure.row_check`` (``engine.tools.row_invariance``) names the first op whose row depends on how
many rows a pass holds."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.measure.row_check import ModuleTap, check
from engine.tools.row_invariance import main
from tests.tiny import tiny_target


def one_row_at_a_time(self, x):
    """A linear layer whose rows never see each other: row-invariant by construction."""
    return torch.cat([F.linear(x[..., i:i + 1, :], self.weight, self.bias) for i in range(x.shape[-2])], dim=-2)


def test_the_first_row_count_dependent_op_is_named(monkeypatch):
    monkeypatch.setattr(torch.nn.Linear, "forward", one_row_at_a_time)
    target = tiny_target()
    norm = target.model.model.layers[0].input_layernorm

    def depends_on_rows(module, inputs, output):  # what a kernel chosen by the row count does, made visible
        return output + 1e-9 * (output.shape[1] - 1)

    norm.register_forward_hook(depends_on_rows)
    with torch.inference_mode():
        checks = check(target, "p", [5, 6, 7, 8, 9], [1, 5, 17])
    by_shape = {(c.shape, c.rows): c for c in checks}
    assert set(by_shape) == {("chain", 1), ("chain", 5), ("tree", 5), ("chain", 17), ("tree", 17)}
    lone = by_shape["chain", 1]
    assert lone.first_module is None and lone.equal_rows == lone.compared_rows == 1 and lone.max_abs_diff == 0
    for key in (("chain", 5), ("tree", 5), ("chain", 17), ("tree", 17)):
        assert by_shape[key].first_row == 0 and by_shape[key].first_module == "model.layers.0.input_layernorm", key
        assert by_shape[key].module_abs_diff == pytest.approx(1e-9 * (key[1] - 1))
    assert by_shape["chain", 17].compared_rows == 17 and by_shape["tree", 17].compared_rows == 8  # AR's path only


def test_a_tree_s_path_rows_are_compared_with_ar_s_steps_of_their_depth(monkeypatch):
    """With every op row-invariant, a tree's path rows are AR's steps bit for bit: its node at depth d (not row d,
    a sibling sits between path nodes) against AR's step d."""
    monkeypatch.setattr(torch.nn.Linear, "forward", one_row_at_a_time)
    target = tiny_target()
    with torch.inference_mode():
        checks = [c for c in check(target, "p", [5, 6, 7, 8, 9], [5, 17]) if c.shape == "tree"]
    found = [(c.rows, c.equal_rows, c.compared_rows, c.max_abs_diff) for c in checks]
    assert found == [(5, 2, 2, 0.0), (17, 8, 8, 0.0)]


def test_a_later_row_leaving_ar_is_found_and_its_module_named(monkeypatch):
    """The root row can be AR's while a later row is not (an attention kernel that tiles its queries): the first
    such row is compared module by module with its own AR step."""
    monkeypatch.setattr(torch.nn.Linear, "forward", one_row_at_a_time)
    target = tiny_target()

    def third_row_on(module, inputs, output):
        if output.shape[1] <= 2:
            return output
        output = output.clone()
        output[:, 2:] += 1e-6
        return output

    target.model.model.layers[0].input_layernorm.register_forward_hook(third_row_on)
    with torch.inference_mode():
        checks = {(c.shape, c.rows): c for c in check(target, "p", [5, 6, 7, 8, 9], [5, 17])}
    for key, first in ((("chain", 5), 2), (("chain", 17), 2), (("tree", 5), 1), (("tree", 17), 1)):
        found = checks[key]  # a tree's chain has a sibling after each node: its second node is row 2
        assert found.first_row == first and found.equal_rows == first, key
        assert found.first_module == "model.layers.0.input_layernorm" and found.module_abs_diff > 0, key


def test_bad_row_counts_are_one_line(capsys):
    assert main(["--rows", "0,17"]) == 2
    assert capsys.readouterr().err.strip() == "error: --rows takes positive row counts, got '0,17'"


@pytest.mark.skipif(torch.cuda.is_available(), reason="what a machine without a GPU answers")
def test_the_vllm_engine_without_a_gpu_is_one_line(capsys):
    assert main(["--engine", "vllm", "--limit", "1"]) == 2
    assert capsys.readouterr().err.strip() == ("error: the vLLM engine needs a CUDA GPU; on this machine use "
                                               "--engine torch")


def test_the_module_tap_reads_the_asked_row_in_either_layout():
    """vLLM's modules output [tokens, ...] (per-head ones [tokens, heads, head size]); Hugging Face's [1, tokens, ...]:
    the tap must take the row's token, not a head of the first token."""
    per_head = torch.nn.Sequential(torch.nn.Unflatten(-1, (2, 3)))
    passes = torch.arange(4 * 6, dtype=torch.float32).view(4, 6)  # 4 tokens, 2 heads of 3
    for batched, run in ((False, passes), (True, passes[None])):
        tap = ModuleTap(per_head, batched)
        tap.row = 2
        per_head(run)
        assert torch.equal(tap.take()["0"], passes[2].view(2, 3)), batched
        tap.close()
