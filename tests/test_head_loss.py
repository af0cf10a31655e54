"""The drafter's loss through the frozen LM head, chunk by chunk (model/head_loss.py), against
the loss computed the plain way: all (B, N, bs-1, V) logits at once, torch's cross-entropy
and autograd. On CPU in fp32, with the trainer's own objective and a tiny random drafter."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3Config

from dflash_train.config import DrafterConfig
from dflash_train.model.head_loss import chunk_rows, head_cross_entropy
from dflash_train.model.drafter import DFlashDrafter, drafter_hf_config
from dflash_train.model.objective import DraftObjective, DrafterInputs
from dflash_train.compiling.step_build import graphs_compiled, random_inputs

pytestmark = pytest.mark.timeout(120)

VOCAB, HIDDEN, BLOCK = 101, 32, 4


def objective(loss_chunk_rows: int | None) -> DraftObjective:
    target = Qwen3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=6,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512)
    drafter = DFlashDrafter(drafter_hf_config(target, DrafterConfig(num_layers=1, block_size=BLOCK, num_anchors=8),
                                              (1, 3), mask_token_id=VOCAB - 1))
    generator = torch.Generator().manual_seed(0)
    drafter.reset_parameters(generator)
    embed, head = torch.randn(VOCAB, HIDDEN, generator=generator), torch.randn(VOCAB, HIDDEN, generator=generator)
    return DraftObjective(drafter, embed, head, use_flex=False, loss_chunk_rows=loss_chunk_rows)


def materialized(objective: DraftObjective, inputs: DrafterInputs):
    """The loss as one V-wide tensor of logits, and its hits."""
    logits = F.linear(objective.block_hidden(inputs), objective.lm_head_weight).float()  # (B, N, bs-1, V)
    token_loss = F.cross_entropy(logits.flatten(0, 2), inputs.labels.flatten(), reduction="none")
    weights = inputs.weights.flatten()
    counted = inputs.weights > 0
    correct = ((logits.argmax(-1) == inputs.labels) & counted).sum(dim=(0, 1))
    return (token_loss * weights).sum() / weights.sum().clamp_min(1e-6), correct, counted.sum(dim=(0, 1))


def gradients(objective: DraftObjective, loss: torch.Tensor) -> list[torch.Tensor]:
    return torch.autograd.grad(loss, [p for p in objective.drafter.parameters()])


@pytest.mark.parametrize("rows", [1, 7, 48, 10_000])  # one position a chunk, a remainder, exact, one chunk
def test_chunked_loss_gradients_and_hits_equal_the_materialized_ones(rows):
    chunked = objective(rows)
    # 3 rows x 8 blocks x 3 positions = 72 positions: several chunks at every size but the last
    inputs = random_inputs(3, 40, 8, block_size=BLOCK, vocab=VOCAB, num_features=2 * HIDDEN,
                           features_dtype=torch.float32, device="cpu", seed=1)
    with torch.no_grad():  # the first position of each block labelled with the drafter's own guess: hits to count
        guesses = F.linear(chunked.block_hidden(inputs), chunked.lm_head_weight).argmax(-1)
    inputs.labels[:, :, 0] = guesses[:, :, 0]
    loss, correct, counted = chunked(inputs)
    reference, reference_correct, reference_counted = materialized(chunked, inputs)
    assert loss.item() == pytest.approx(reference.item(), rel=1e-6)
    assert torch.equal(correct, reference_correct) and torch.equal(counted, reference_counted)
    assert correct.sum() > 0  # a hit count that is always zero would compare equal too
    for got, want in zip(gradients(chunked, loss), gradients(chunked, reference)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.slow(seconds=10, why="torch.compile (aot_eager) of the objective with dynamic shapes, forward and backward")
def test_the_chunks_trace_with_dynamic_shapes_and_give_the_eager_loss():
    eager = objective(5)
    # aot_eager: Dynamo and AOTAutograd trace the op with symbolic sizes (its fake and its
    # backward), as under Inductor, which runs it as an opaque kernel; minutes less on a CPU.
    compiled = torch.compile(eager, dynamic=True, backend="aot_eager")
    traced = []  # Dynamo's graphs so far, after each size
    before = graphs_compiled()
    for rows in (2, 3):
        inputs = random_inputs(rows, 24, 8, block_size=BLOCK, vocab=VOCAB, num_features=2 * HIDDEN,
                               features_dtype=torch.float32, device="cpu", seed=rows)
        got, want = compiled(inputs)[0], eager(inputs)[0]
        traced.append(graphs_compiled())
        assert got.item() == pytest.approx(want.item(), rel=1e-5)
        for a, b in zip(gradients(eager, got), gradients(eager, want)):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    # one compile serves both sizes: the first traced, the second traced nothing
    assert traced[0] > before and traced[1] == traced[0], (before, traced)


def test_a_chunk_holds_a_gibibyte_of_fp32_logits():
    assert chunk_rows(151_936) == (1 << 30) // (4 * 151_936) == 1766
    assert chunk_rows(2**40) == 1  # a vocabulary wider than the budget still makes progress


def test_the_gradient_basis_is_the_softmax_minus_the_label_through_the_head():
    hidden, head = torch.randn(5, HIDDEN), torch.randn(VOCAB, HIDDEN)
    labels = torch.randint(0, VOCAB, (5,))
    _, _, basis = head_cross_entropy(hidden, head, labels, 2)
    expected = (torch.softmax(hidden @ head.t(), -1) - F.one_hot(labels, VOCAB)) @ head
    torch.testing.assert_close(basis, expected)
