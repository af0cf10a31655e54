"""Training labels match what inference drafts: a truncated answer is never closed inside
the loss, and a block never learns across a user turn into another answer. On CPU, with
the tiny target's tokenizer and synthetic data built at test time."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dflash_train.config import NO_TURN, DataConfig, DrafterConfig, load_job_config
from dflash_train.data.batches import BatchPlan, Sample, collate, load_samples, tokenize_sample
from dflash_train.data.chat import tokenize_chat
from dflash_train.model.objective import anchor_candidates, block_labels, position_weights
from dflash_train.data.tiny import ensure_tiny_assets

TINY_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "train" / "tiny-cpu.yaml"
pytestmark = pytest.mark.timeout(180)

END = "<|im_end|>"


@pytest.fixture(scope="module")
def tiny_cpu_assets(workspace):
    """The shipped tiny-cpu.yaml's target and data (the end-to-end run's cache entry)."""
    config = load_job_config(TINY_CONFIG)
    return config, ensure_tiny_assets(config.target.tiny, config.data.synthetic, workspace / "cache")


@pytest.fixture(scope="module")
def tokenizer(tiny_cpu_assets):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(tiny_cpu_assets[1].target_dir))


def learnt(tokenizer, sample: Sample) -> list[tuple[str, int]]:
    """(token, turn) of every token the drafter learns."""
    tokens = tokenizer.convert_ids_to_tokens(sample.ids.tolist())
    return [(tok, int(turn)) for tok, turn in zip(tokens, sample.turn_ids) if turn != NO_TURN]


def chat(answer: str, **extra) -> dict:
    return {"messages": [{"role": "user", "content": "w1 w2"}, {"role": "assistant", "content": answer}], **extra}


def test_a_truncated_answer_learns_no_end_of_turn(tokenizer):
    cut = tokenize_sample(chat("w3 w4 w5", truncated=True), tokenizer, 128, "test")
    assert learnt(tokenizer, cut) == [("w3", 0), ("w4", 0), ("w5", 0)]
    # The end-of-turn is still in the sequence (the target's features see the whole text), unlearnt.
    assert tokenizer.convert_ids_to_tokens(cut.ids.tolist())[-1] == END and cut.turn_ids[-1] == NO_TURN
    # No block is anchored on the answer's last token: it would have nothing to learn.
    assert [tokenizer.convert_ids_to_tokens(int(cut.ids[a])) for a in anchor_candidates(cut.turn_ids)] == ["w3", "w4"]
    # An answer the target ended itself learns its end: that is what it drafts.
    ended = tokenize_sample(chat("w3 w4 w5", truncated=False), tokenizer, 128, "test")
    assert learnt(tokenizer, ended) == [("w3", 0), ("w4", 0), ("w5", 0), (END, 0)]
    assert torch.equal(ended.ids, cut.ids)


def test_truncation_finds_the_answer_end_whatever_the_template_appends(tokenizer):
    """A template that trims the content and closes the turn with more than the end-of-turn
    token (Qwen's ends with `<|im_end|>\\n`): only the answer's own tokens are learnt."""
    from transformers import AutoTokenizer
    other = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    other.chat_template = ("{% for message in messages %}<|im_start|>{{ message['role'] }} "
                           "{{ message['content'] | trim }}<|im_end|>\n<|endoftext|> {% endfor %}"
                           "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}")
    cut = tokenize_sample(chat("w3 w4  ", truncated=True), other, 128, "test")
    assert learnt(other, cut) == [("w3", 0), ("w4", 0)]
    ended = tokenize_sample(chat("w3 w4  "), other, 128, "test")
    assert learnt(other, ended) == [("w3", 0), ("w4", 0), (END, 0), ("<|endoftext|>", 0)]


def test_a_cut_at_max_length_learns_no_end_of_turn(tokenizer):
    # <|im_start|> user w1 w2 <|im_end|> <|im_start|> assistant w3 w4 w5 <|im_end|>: cut after w4
    sample = tokenize_sample(chat("w3 w4 w5"), tokenizer, 9, "test")
    assert learnt(tokenizer, sample) == [("w3", 0), ("w4", 0)]


@pytest.mark.parametrize("row, message", [
    (chat("w3", truncated="yes"), "test: 'truncated' must be true or false, not 'yes'"),
    ({"messages": [{"role": "user", "content": "w1"}], "truncated": True},
     "test: 'truncated' is true but the last message is not the assistant's"),
    ({"messages": [{"role": "user", "content": "w1"}, {"role": "assistant", "content": ["w2"]}],
      "truncated": True}, "test: 'truncated' needs the last message's content to be a string"),
])
def test_bad_truncated_field_is_refused_naming_the_line(tokenizer, row, message):
    with pytest.raises(ValueError) as info:
        tokenize_sample(row, tokenizer, 128, "test")
    assert str(info.value) == message


def test_load_samples_reads_the_truncated_field(tokenizer, tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps(chat("w3 w4", truncated=True)) + "\n" + json.dumps(chat("w3 w4", truncated=1)) + "\n")
    with pytest.raises(ValueError, match=rf"^{path}:2: 'truncated' must be true or false, not 1$"):
        load_samples(path, tokenizer, 128, tmp_path / "cache")
    path.write_text(json.dumps(chat("w3 w4", truncated=True)) + "\n")
    [sample] = load_samples(path, tokenizer, 128, tmp_path / "cache")
    assert learnt(tokenizer, sample) == [("w3", 0), ("w4", 0)]



def test_a_file_that_gives_no_sample_says_whether_it_is_empty_or_too_long_for_max_length(tokenizer, tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("\n\n")
    with pytest.raises(ValueError) as empty:
        load_samples(path, tokenizer, 32, tmp_path / "cache")
    assert str(empty.value) == f"{path}: the file holds no conversation (it is empty)"
    # Each answer starts past token 32: cut at max_length, no conversation keeps one.
    rows = [{"messages": [{"role": "user", "content": " ".join(f"w{i}" for i in range(words))},
                          {"role": "assistant", "content": "w1 w2 w3"}]} for words in (40, 45, 50)]
    longest = max(len(tokenize_chat(tokenizer, row["messages"], "test")[0]) for row in rows)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(ValueError) as over:
        load_samples(path, tokenizer, 32, tmp_path / "cache")
    assert str(over.value) == (f"{path}: 3 of 3 conversations are longer than data.max_length 32 (the longest "
                               f"{longest} tokens): cut there, none keeps a learnable token; raise data.max_length "
                               "or shorten them")
    # Not every one too long: the others have nothing to learn at any length.
    path.write_text(json.dumps(rows[0]) + "\n" + json.dumps({"messages": rows[0]["messages"][:1]}) + "\n")
    with pytest.raises(ValueError, match=r": no sample has a learnable .*; 1 of 2 conversations are longer than "
                                         r"data.max_length 32 \(the longest \d+ tokens\)$"):
        load_samples(path, tokenizer, 32, tmp_path / "cache")

def test_synthetic_data_marks_truncated_answers_and_none_is_closed_inside_the_loss(tiny_cpu_assets, tokenizer):
    """The shipped tiny config: most synthetic answers run to response_tokens without the
    target ending them; before, every one of those learnt an end-of-turn."""
    config, assets = tiny_cpu_assets
    rows = [json.loads(line) for line in assets.train_path.read_text().splitlines()]
    limit = config.data.synthetic.response_tokens
    truncated = [row for row in rows if row.get("truncated")]
    # Cut exactly when the answer has response_tokens tokens (an answer the target ended
    # has at most response_tokens - 1 before its end-of-turn).
    assert all(row.get("truncated", False) == (len(row["messages"][-1]["content"].split()) == limit)
               for row in rows)
    assert len(rows) > len(truncated) > len(rows) // 2, (len(truncated), len(rows))
    closed = 0
    for number, row in enumerate(rows, 1):
        sample = tokenize_sample(row, tokenizer, config.data.max_length, f"train.jsonl:{number}")
        tokens = [tok for tok, _ in learnt(tokenizer, sample)]
        if row.get("truncated"):
            closed += END in tokens
            assert tokens == row["messages"][-1]["content"].split()
        else:
            assert tokens[-1] == END
    assert closed == 0, f"{closed} of {len(truncated)} truncated answers learn an end-of-turn"


# --- multi-turn: a block stays in its anchor's turn ---------------------------------------

TWO_TURNS = {"messages": [{"role": "user", "content": "w1 w2"}, {"role": "assistant", "content": "w3 w4 w5"},
                          {"role": "user", "content": "w6"}, {"role": "assistant", "content": "w7 w8 w9 w10"}]}


def test_turn_ids_number_each_assistant_turn(tokenizer):
    sample = tokenize_sample(TWO_TURNS, tokenizer, 128, "test")
    assert learnt(tokenizer, sample) == [("w3", 0), ("w4", 0), ("w5", 0), (END, 0),
                                         ("w7", 1), ("w8", 1), ("w9", 1), ("w10", 1), (END, 1)]


def test_a_block_crossing_a_user_turn_learns_nothing_past_its_turn(tokenizer):
    sample = tokenize_sample(TWO_TURNS, tokenizer, 128, "test")
    tokens = tokenizer.convert_ids_to_tokens(sample.ids.tolist())
    anchor = tokens.index("w4")
    weights_k = position_weights(16, 7.0)
    labels, weights = block_labels(sample.ids.long()[None], sample.turn_ids.long()[None], torch.tensor([[anchor]]),
                                   torch.tensor([[True]]), weights_k)
    # Block position k predicts the token at anchor + k: w5 and <|im_end|> are its turn's,
    # the user turn and the next answer are not, even where the next answer's tokens are learnt.
    predicted = tokenizer.convert_ids_to_tokens(labels[0, 0].tolist())
    assert predicted[:2] == ["w5", END] and {"w6", "w7", "w8"} <= set(predicted)
    assert weights[0, 0, :2].tolist() == pytest.approx(weights_k[:2].tolist())
    assert weights[0, 0, 2:].sum() == 0


def test_collated_weights_never_leave_the_anchors_turn(tokenizer):
    """Every block the collator makes from two-turn chats, every anchor there is: a position
    carries weight exactly when it is in the anchor's turn and inside the sequence."""
    samples = [tokenize_sample(TWO_TURNS, tokenizer, 128, "test"), tokenize_sample(chat("w3 w4 w5"), tokenizer, 128, "t")]
    data = DataConfig(synthetic=None, train="train.jsonl", max_length=128, token_budget=1024, pad_multiple=16)
    drafter = DrafterConfig(block_size=16, num_anchors=64)
    plan = BatchPlan(samples, data, replicas=1, epochs=1, max_steps=None, seed=0)
    [entry] = plan.entries
    batch = collate(samples, entry, 1, 0, data, drafter, pad_id=0, seed=0)
    crossing = 0
    for row, index in enumerate(entry.samples):
        turns = samples[index].turn_ids.tolist()
        anchors = batch.anchors[row][batch.anchor_valid[row]].tolist()
        assert anchors == anchor_candidates(samples[index].turn_ids).tolist()  # all of them: 64 allowed
        for block, anchor in enumerate(anchors):
            for k in range(1, drafter.block_size):
                in_turn = anchor + k < len(turns) and turns[anchor + k] == turns[anchor]
                crossing += anchor + k < len(turns) and turns[anchor + k] not in (turns[anchor], NO_TURN)
                assert (batch.weights[row, block, k - 1] > 0) == in_turn, (index, anchor, k)
    assert crossing > 0  # some block did reach into the next answer


def test_an_accumulating_plan_uses_every_micro_batch_once_in_step_order():
    samples = [Sample(torch.arange(5 + i % 7), torch.zeros(5 + i % 7, dtype=torch.long)) for i in range(60)]
    data = DataConfig(train="unused.jsonl", max_length=16, token_budget=16, pad_multiple=8)
    plain = BatchPlan(samples, data, replicas=2, epochs=2, max_steps=None, seed=3)
    plan = BatchPlan(samples, data, replicas=2, epochs=2, max_steps=None, seed=3, accumulate=3)
    used = [plan.entry(step, g, m) for step in range(1, plan.total_steps + 1) for m in range(3) for g in range(2)]
    assert used == plan.entries  # one entry each (step, micro-batch, replica), none skipped or repeated
    assert plan.total_steps == len(plan.entries) // 6
    assert [plan.step_entries(s) for s in (1, 2)] == [used[:6], used[6:12]]
    assert plan.last_entry(2) == plan.entry(2, 1, 2) == used[11]
    # an epoch ends on a whole step: its tail of fewer than 6 micro-batches is left out
    assert all(len([e for e in plan.entries if e.epoch == epoch]) % 6 == 0 for epoch in (0, 1))
    # accumulate 1 is the plan as it was: entry (s-1)*G + g
    assert [plain.entry(s, g) for s in range(1, plain.total_steps + 1) for g in range(2)] == plain.entries
