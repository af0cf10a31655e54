"""The loss mask on the chat templates the targets ship (tests/data/chat_templates, its
README says whose each is): set on a tiny tokenizer with the family's special tokens, a
conversation of system, user, tool and assistant turns learns, turn by turn, exactly the
text the template renders for each answer after the generation prompt the target
answered, through its end of turn, and nothing of a prompt, a system message or a tool's
output. A template the mask cannot read is refused, row by row and, naming the target's
tokenizer, at start-up: here in the function, and through the real CLI on the `local`
host, where the run fails before a step."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from dflash_run import dflash
from dflash_train.config import NO_TURN, TinyTargetSpec
from dflash_train.data.batches import first_chat_row, load_samples
from dflash_train.data.chat import check_chat_template, tokenize_chat
from dflash_train.data.tiny import TARGET_DATA, ensure_tiny_assets
from support.train_configs import small_config

pytestmark = pytest.mark.timeout(120)
TEMPLATES = Path(__file__).resolve().parent / "data" / "chat_templates"

# Each template's special tokens (what its tokenizer has as added tokens), its bos and eos.
SPECIAL_TOKENS = {
    "llama-3.1-8b-instruct": ("<|begin_of_text|>", "<|eot_id|>", ["<|start_header_id|>", "<|end_header_id|>",
                                                                    "<|eom_id|>", "<|python_tag|>"]),
    "gpt-oss": ("<|startoftext|>", "<|return|>", ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|call|>",
                                                  "<|constrain|>"]),
    "gemma-2-it": ("<bos>", "<eos>", ["<start_of_turn>", "<end_of_turn>"]),
    "gemma-3-it": ("<bos>", "<eos>", ["<start_of_turn>", "<end_of_turn>"]),
    "mistral-7b-instruct-v0.3": ("<s>", "</s>", ["[INST]", "[/INST]"]),
    "qwen3": (None, "<|im_end|>", ["<|im_start|>", "<|endoftext|>", "<think>", "</think>"]),
}


def template_tokenizer(name: str):
    """A fast tokenizer of one token per byte plus the template's special tokens, the
    template set as its chat template: every character of a rendering is in exactly one
    token, so what is learnt is exactly a span of the text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    bos, eos, others = SPECIAL_TOKENS[name]
    backend = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))},
                                   merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([token for token in (bos, eos, *others) if token])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=eos, pad_token=eos,
                                        **({"bos_token": bos} if bos else {}))
    tokenizer.chat_template = (TEMPLATES / f"{name}.jinja").read_text()
    return tokenizer


def learnt(tokenizer, messages: list[dict], truncated: bool = False, **template_kwargs) -> list[str]:
    """The text each assistant turn learns, turn by turn; a turn's tokens are one run."""
    ids, turns = tokenize_chat(tokenizer, messages, "test", truncated, template_kwargs)
    runs = [turn for index, turn in enumerate(turns) if turn != NO_TURN and (index == 0 or turns[index - 1] != turn)]
    assert runs == list(range(len(runs))), turns  # each turn once, in order, in one piece
    return [tokenizer.decode([i for i, turn in zip(ids, turns) if turn == number]) for number in runs]


SYSTEM = {"role": "system", "content": "Answer in one short sentence."}
FRANCE = {"role": "user", "content": "What is the capital of France?"}
ITALY = {"role": "user", "content": "And of Italy?"}


def answer(content: str, **extra) -> dict:
    return {"role": "assistant", "content": content, **extra}


def two_turns(first: dict, second: dict, system: bool = True) -> list[dict]:
    return [SYSTEM] * system + [FRANCE, first, ITALY, second]


# --- each family's template -------------------------------------------------------------------

def test_llama_3_1_learns_each_trimmed_answer_and_its_end_of_turn():
    tokenizer = template_tokenizer("llama-3.1-8b-instruct")
    assert learnt(tokenizer, two_turns(answer("Paris.\n"), answer(" Rome."))) == ["Paris.<|eot_id|>", "Rome.<|eot_id|>"]
    # A tool call is the assistant's (it wrote it); the tool's output is not.
    call = {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "weather",
                                                                                  "arguments": {"city": "Paris"}}}]}
    chat = [FRANCE, call, {"role": "tool", "content": "sunny, 24C"}, answer("Sunny in Paris.")]
    assert learnt(tokenizer, chat) == ['{"name": "weather", "parameters": {"city": "Paris"}}<|eot_id|>',
                                       "Sunny in Paris.<|eot_id|>"]


def test_gpt_oss_learns_the_final_channel_and_the_last_turns_analysis():
    tokenizer = template_tokenizer("gpt-oss")
    # The generation prompt is `<|start|>assistant`: the channel header is the target's. The
    # last turn's thinking is its analysis message; an earlier turn's is dropped, and so is
    # its `<|end|>`, which the target never wrote (it ended that answer with <|return|>).
    chat = two_turns(answer("Paris.", thinking="France: Paris."), answer("Rome.", thinking="Italy next."))
    assert learnt(tokenizer, chat) == [
        "<|channel|>final<|message|>Paris.",
        "<|channel|>analysis<|message|>Italy next.<|end|><|start|>assistant<|channel|>final<|message|>Rome.<|return|>"]
    assert learnt(tokenizer, [SYSTEM, FRANCE, answer("Paris.")]) == ["<|channel|>final<|message|>Paris.<|return|>"]


@pytest.mark.parametrize("name", ["gemma-2-it", "gemma-3-it"])
def test_gemma_learns_each_answer_and_its_end_of_turn(name):
    tokenizer = template_tokenizer(name)
    chat = two_turns(answer("Paris. "), answer("Rome."), system=False)
    assert learnt(tokenizer, chat) == ["Paris.<end_of_turn>\n", "Rome.<end_of_turn>\n"]


def test_gemma_2_refuses_a_system_message_and_gemma_3_folds_it_into_the_prompt():
    chat = two_turns(answer("Paris."), answer("Rome."))
    with pytest.raises(ValueError) as refused:
        learnt(template_tokenizer("gemma-2-it"), chat)
    assert str(refused.value) == "test: the chat template refuses this conversation: System role not supported"
    assert learnt(template_tokenizer("gemma-3-it"), chat) == ["Paris.<end_of_turn>\n", "Rome.<end_of_turn>\n"]


def test_mistral_learns_each_answer_with_its_leading_space_and_end_of_sequence():
    tokenizer = template_tokenizer("mistral-7b-instruct-v0.3")
    assert learnt(tokenizer, two_turns(answer("Paris."), answer("Rome.\n"), system=False)) == [" Paris.</s>", " Rome.</s>"]
    # It puts a system message into the last user turn only when that turn ends the
    # conversation, so a conversation ending with an answer renders none: refused.
    with pytest.raises(ValueError, match=r"^test: the chat template does not render the conversation through turn 2 "
                                         r"as that turn's prompt followed by its answer, so turn 2's tokens cannot be"):
        learnt(tokenizer, [SYSTEM, FRANCE, answer("Paris.")])


def test_qwen3_with_thinking_learns_the_last_turns_reasoning_and_the_earlier_turns_answer():
    tokenizer = template_tokenizer("qwen3")
    # The template drops an earlier turn's reasoning once a later user turn follows: that
    # turn learns the answer the whole conversation renders. (Before, every such
    # conversation was refused: the earlier turn did not render as a prefix of it.)
    expected = ["Paris.<|im_end|>\n", "<think>\nItaly next.\n</think>\n\nRome.<|im_end|>\n"]
    field = two_turns(answer("Paris.", reasoning_content="France: Paris."),
                      answer("Rome.", reasoning_content="Italy next."))
    assert learnt(tokenizer, field) == expected
    inline = two_turns(answer("<think>\nFrance: Paris.\n</think>\n\nParis."),
                       answer("<think>\nItaly next.\n</think>\n\nRome."))
    assert learnt(tokenizer, inline) == expected
    # The target in thinking mode writes a think block even when it is empty.
    assert learnt(tokenizer, [FRANCE, answer("Paris.")]) == ["<think>\n\n</think>\n\nParis.<|im_end|>\n"]
    # A truncated answer learns its reasoning and content, not the end of turn.
    cut = [FRANCE, answer("<think>\nFrance: Paris.\n</think>\n\nPar")]
    assert learnt(tokenizer, cut, truncated=True) == ["<think>\nFrance: Paris.\n</think>\n\nPar"]
    # A tool call with no content before a later answer cannot be located (the template
    # puts a newline before the call only after a content): refused, never mislearnt.
    call = answer("", tool_calls=[{"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}])
    with pytest.raises(ValueError, match="^test: the chat template does not render turn 1's content in the whole "
                                         "conversation as it does when the turn ends it"):
        learnt(tokenizer, [FRANCE, call, {"role": "tool", "content": "sunny, 24C"}, answer("Sunny.")])
    last = learnt(tokenizer, [FRANCE, answer("", tool_calls=call["tool_calls"])])
    assert last == ['<think>\n\n</think>\n\n<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n'
                    '</tool_call><|im_end|>\n']


def test_qwen3_without_thinking_leaves_the_empty_think_block_to_the_prompt():
    tokenizer = template_tokenizer("qwen3")
    chat = two_turns(answer("Paris."), answer("Rome."))
    assert learnt(tokenizer, chat, enable_thinking=False) == ["Paris.<|im_end|>\n", "Rome.<|im_end|>\n"]
    ids, _ = tokenize_chat(tokenizer, chat, "test", template_kwargs={"enable_thinking": False})
    assert tokenizer.decode(ids).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nRome.<|im_end|>\n")
    # Reasoning in an answer the target gave without thinking contradicts the prompt: refused.
    with pytest.raises(ValueError, match="does not render the conversation through turn 1 as that turn's prompt"):
        learnt(tokenizer, [FRANCE, answer("Paris.", reasoning_content="France: Paris.")], enable_thinking=False)


def test_enable_thinking_is_part_of_the_tokenized_data_cache_key(tmp_path):
    tokenizer = template_tokenizer("qwen3")
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"messages": [FRANCE, answer("Paris is the capital.")]}) + "\n")
    thinking = load_samples(path, tokenizer, 512, tmp_path / "cache", workers=1)
    plain = load_samples(path, tokenizer, 512, tmp_path / "cache", workers=1, template_kwargs={"enable_thinking": False})
    learnt_text = [tokenizer.decode(sample.ids[sample.turn_ids != NO_TURN].tolist()) for sample in (thinking[0], plain[0])]
    assert learnt_text == ["<think>\n\n</think>\n\nParis is the capital.<|im_end|>\n", "Paris is the capital.<|im_end|>\n"]


# --- the start-up check --------------------------------------------------------------------------

CHECKED = {"llama-3.1-8b-instruct": True, "gpt-oss": True, "gemma-2-it": False, "gemma-3-it": True,
           "mistral-7b-instruct-v0.3": False, "qwen3": True}  # whether the conversation has a system message


@pytest.mark.parametrize("name", sorted(CHECKED))
def test_every_shipped_template_passes_the_start_up_check(name):
    chat = two_turns(answer("Paris."), answer("Rome."), system=CHECKED[name])
    check_chat_template(template_tokenizer(name), f"target.path /models/{name}", chat, "/data/train.jsonl:1")


TINY_CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|> {% endfor %}"
               "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}")
UNREADABLE = {
    "none": (None, "its tokenizer has no chat template (no chat_template in tokenizer_config.json, no "
                   "chat_template.jinja), and /data/train.jsonl:1 is a chat \"messages\" row"),
    "rewrites the answer": (TINY_CHATML.replace("{{ m['content'] }}", "{% if m['role'] == 'assistant' %}"
                                                                        "{{ m['content'] | upper }}{% else %}"
                                                                        "{{ m['content'] }}{% endif %}"),
                            "its chat template cannot be read for the loss mask, on a conversation of the turns of "
                            "/data/train.jsonl:1 (user, assistant, user, assistant): it does not render message 1 "
                            "(assistant)'s content as given (it leaves it out or rewrites it)"),
    "drops earlier answers": (TINY_CHATML.replace("{{ m['content'] }}", "{% if m['role'] != 'assistant' or loop.last "
                                                                          "%}{{ m['content'] }}{% endif %}"),
                              "it does not render message 1 (assistant)'s content as given"),
    "reorders": (TINY_CHATML.replace("messages %}", "messages | reverse %}"),
                 "it renders message 3 (assistant) before message 0 (user)"),
    "puts the prompt in the answer": ("{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>assistant "
                                      "{{ messages[loop.index0 - 1]['content'] }} {{ m['content'] }}<|im_end|> "
                                      "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant "
                                      "{% endif %}", "what turn 1 learns holds message 0 (user)'s content"),
}


@pytest.mark.parametrize("case", sorted(UNREADABLE))
def test_a_template_the_mask_cannot_read_is_refused_at_start_up_naming_it(case):
    template, problem = UNREADABLE[case]
    tokenizer = template_tokenizer("qwen3")
    tokenizer.chat_template = template
    chat = two_turns(answer("Paris."), answer("Rome."), system=False)
    with pytest.raises(ValueError) as refused:
        check_chat_template(tokenizer, "target.path /models/broken", chat, "/data/train.jsonl:1")
    assert str(refused.value).startswith("target.path /models/broken: ") and problem in str(refused.value)


@pytest.mark.parametrize("name, problem", [
    ("mistral-7b-instruct-v0.3", "(system, user, assistant): it does not render message 0 (system)'s content as "
                                 "given (it leaves it out or rewrites it)"),
    ("gemma-2-it", "(system, user, assistant): the chat template refuses this conversation: System role not supported"),
])
def test_a_real_template_that_cannot_take_the_datas_system_message_is_refused_at_start_up(name, problem):
    with pytest.raises(ValueError) as refused:
        check_chat_template(template_tokenizer(name), f"target.path /models/{name}", [SYSTEM, FRANCE, answer("Paris.")],
                            "/data/train.jsonl:1")
    assert str(refused.value) == (f"target.path /models/{name}: its chat template cannot be read for the loss mask, "
                                  f"on a conversation of the turns of /data/train.jsonl:1 {problem}")


def test_the_first_chat_row_is_the_files_first_non_blank_row(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text('\n  \n{"messages": [{"role": "user", "content": "hi"}]}\n{"text": "x"}\n')
    assert first_chat_row(path) == (3, [{"role": "user", "content": "hi"}])
    path.write_text('{"text": "x"}\n{"messages": []}\n')
    assert first_chat_row(path) is None  # text data: no template to check
    path.write_text("")
    assert first_chat_row(path) is None


# --- through the CLI -------------------------------------------------------------------------------

@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """The built-in `local` host's workspace lives under ~; no inventory in the current folder."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.mark.timeout(300)
@pytest.mark.slow(seconds=12, why="launches the real trainer on CPU, which fails at start-up")
def test_a_run_whose_template_drops_earlier_answers_fails_at_start_up_naming_it(home, workspace, tmp_path):
    assets = ensure_tiny_assets(TinyTargetSpec(), TARGET_DATA, workspace / "cache")
    target = tmp_path / "target with its own template"
    shutil.copytree(assets.target_dir, target)
    # Earlier answers rendered without their content: a conversation of two turns would
    # teach the first turn nothing of its answer.
    (target / "chat_template.jinja").write_text(
        "{% for m in messages %}<|im_start|>{{ m['role'] }} {% if m['role'] != 'assistant' or loop.last %}"
        "{{ m['content'] }}{% endif %}<|im_end|> {% endfor %}{% if add_generation_prompt %}<|im_start|>assistant "
        "{% endif %}")
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": "w1 w2"}, answer("w3 w4"),
                                                     {"role": "user", "content": "w5"}, answer("w6 w7 w8")]}) + "\n"
                            for _ in range(8)))
    config = small_config(tmp_path / "c.yaml", data={"synthetic": None, "train": str(data), "max_length": 64,
                                                     "token_budget": 256})
    text = yaml.safe_load(config.read_text())
    config.write_text(yaml.safe_dump({**text, "target": {"path": str(target)}}))
    done = dflash("--logs-dir", str(tmp_path / "logs"), "launch", "local", "--config", str(config), "--follow",
                  cwd=tmp_path, env={"HOME": str(home)})
    assert done.returncode == 1, done.stderr[-3000:]  # cli.md: the run failed
    message = (f"target.path {target}: its chat template cannot be read for the loss mask, on a conversation of the "
               f"turns of {data}:1 (user, assistant, user, assistant): it does not render message 1 (assistant)'s "
               "content as given (it leaves it out or rewrites it)")
    # The traceback, ending with the message, on stdout; the diagnosis line on stderr.
    assert message in " ".join(done.stdout.split()), done.stdout
    shown = " ".join(done.stderr.split())
    assert (f"diagnosis: the chat template of target.path {target}'s tokenizer cannot be read for the loss mask "
            "(refused at start-up, before any row was tokenized); fix the chat template") in shown
    run_id = done.stdout.splitlines()[0]
    run_dir = home / ".dflash" / "local" / "runs" / run_id
    (record,) = [json.loads(line) for line in (run_dir / "errors.jsonl").read_text().splitlines()]
    assert record["exc_type"] == "ValueError" and record["message"] == message and record["phase"] == "startup"
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert not [e for e in events if e["type"] == "step"] and events[-1]["type"] == "done"
    assert events[-1]["exit_code"] == 1
    assert not (run_dir / "checkpoints").exists() or not any((run_dir / "checkpoints").iterdir())
