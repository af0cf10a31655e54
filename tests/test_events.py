"""The events schema (remote/dflash_contract/events): what the trainer's EventLog.emit refuses and
how it says so, the readers' names for fields, and docs/events.md made from it. That every
event a real run writes fits it: test_trainer_runs (the tiny CPU run), test_regenerate,
test_speculative (the evaluate job) and test_resume (the supervisor's attempt marker)."""
from __future__ import annotations

import ast
import json
import threading
from pathlib import Path

import dflash_contract.events
import pytest
from dflash_contract.events import DONE, STARTUP, STEP, EventError, EventType
from dflash_contract.events.__main__ import markdown
from dflash_contract.events.fields import INT, Field
from dflash_train.runlog import EventLog

REPO = Path(__file__).resolve().parents[1]

A_STEP = {"step": 3, "total_steps": 96, "epoch": 0, "loss": 5.25, "acc": [0.5, None, 0.125], "lr": 3e-4,
          "grad_norm": 1.5, "micro_batches": 2, "samples": 8, "tokens": 812, "tokens_per_s": 4060.0,
          "samples_per_s": 40.0, "queue_depths": {"target-0": 1, "drafter-0": 0}, "wait_s": {"prefetch": 0.01},
          "peak_memory_bytes": [None, 1 << 30]}


def written(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("fields, field, problem", [
    ({**A_STEP, "losss": 5.0}, "losss", "unknown field"),
    ({k: v for k, v in A_STEP.items() if k != "loss"}, "loss", "required but missing"),
    ({**A_STEP, "loss": "5.25"}, "loss", "expected a number, got '5.25' (str)"),
    ({**A_STEP, "step": True}, "step", "expected an integer, got True (bool)"),
    ({**A_STEP, "acc": [0.5, "high"]}, "acc", "item 1: expected a number or null, got 'high' (str)"),
    ({**A_STEP, "queue_depths": {"target-0": 1.5}}, "queue_depths", "key 'target-0': expected an integer, got 1.5"),
])
def test_emit_refuses_an_event_that_does_not_fit_naming_its_type_and_field(tmp_path, fields, field, problem):
    log = EventLog(tmp_path / "events.jsonl")
    log.emit(STEP, **A_STEP)
    with pytest.raises(EventError) as refused:
        log.emit(STEP, **fields)
    assert (refused.value.event, refused.value.field) == ("step", field)
    assert str(refused.value).startswith(f"step event: field {field!r}: {problem}")
    [kept] = written(tmp_path / "events.jsonl")  # the refused one is not written
    assert kept == {"ts": kept["ts"], "type": "step", "thread": "MainThread", **A_STEP}


def test_done_is_the_last_event_whichever_thread_writes_after_it(tmp_path, capfd):
    # The start-up pulse and threads that outlived the stop write while the coordinator ends
    # the run: the file ends with the done event all the same.
    log = EventLog(tmp_path / "events.jsonl")
    ending, under_way = threading.Event(), threading.Barrier(5)

    def pulse():
        under_way.wait()
        while not ending.is_set():
            log.emit(STARTUP, phase="load target", state="alive", label="load target", elapsed_s=1.0, cpu_s=0.5,
                     io_bytes=0)
    pulses = [threading.Thread(target=pulse) for _ in range(4)]
    for thread in pulses:
        thread.start()
    try:
        under_way.wait()
        log.emit(DONE, exit_code=1, threads_alive=["startup-pulse"])
        after = threading.Thread(target=log.emit, args=(STEP,), kwargs=A_STEP)
        after.start()
        after.join()
    finally:
        ending.set()
        for thread in pulses:
            thread.join()
    events = written(tmp_path / "events.jsonl")
    assert [e["type"] for e in events].index("done") == len(events) - 1
    assert "step event not written: it came after the done event" in capfd.readouterr().out


def test_a_start_up_phase_and_its_detail_are_declared(tmp_path):
    log = EventLog(tmp_path / "events.jsonl")
    log.emit(STARTUP, phase="load target", state="started", label="load target", devices=["cuda:0"])
    with pytest.raises(EventError, match=r"^startup event: field 'phase': 'warm up' \(str\) is not one of the "
                                         r"schema's: 'import', 'join peers', 'find sources', "):
        log.emit(STARTUP, phase="warm up", state="started", label="warm up")
    with pytest.raises(EventError, match="^startup event: field 'device': unknown field"):
        log.emit(STARTUP, phase="load target", state="started", label="load target", device="cuda:0")
    with pytest.raises(EventError, match="^startup event: field 'state': expected one of 'started', 'alive'"):
        log.emit(STARTUP, phase="load target", state="begun", label="load target")
    assert len(written(tmp_path / "events.jsonl")) == 1


def test_a_record_of_no_declared_type_or_of_another_type_is_refused():
    with pytest.raises(EventError, match=r"^'stpe' event: no such event type in the schema"):
        dflash_contract.events.check({"ts": 1.0, "type": "stpe", "thread": "coordinator"})
    with pytest.raises(EventError, match=r"^step event: field 'type': expected 'step', got 'eval'"):
        STEP.check({"ts": 1.0, "type": "eval", "thread": "eval", **A_STEP})


def test_readers_name_fields_through_their_type_and_a_field_it_lacks_fails_there():
    assert (STEP.name, STEP.loss, STARTUP.label) == ("step", "loss", "label")
    with pytest.raises(AttributeError, match="step events have no field 'losss'"):
        STEP.losss  # noqa: B018 - the read is the test
    assert STEP.matches({"type": "step"}) and not STEP.matches({"type": "eval", "step": 3})
    with pytest.raises(ValueError, match=r"hide attributes of EventType"):
        EventType("odd", "A field named like an attribute could not be read by name.", (), (Field("name", INT, ""),))


def test_every_type_is_written_by_some_code_and_every_write_names_a_declared_type():
    """What `emit(KIND, ...)` and `KIND.record(...)` name in the trainer and the agent is
    the schema, no more and no less (a type nobody writes would be documented for nothing)."""
    names = set()
    for path in sorted((REPO / "remote").glob("dflash_*/**/*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                if node.func.attr == "emit" and node.args and not isinstance(node.args[0], ast.Dict):
                    kind = node.args[0]
                elif node.func.attr == "record" and isinstance(node.func.value, (ast.Name, ast.Attribute)):
                    kind = node.func.value
                else:
                    continue
                name = kind.attr if isinstance(kind, ast.Attribute) else getattr(kind, "id", None)
                if name is not None and name.isupper():
                    names.add(name)
    declared = {name for name in dir(dflash_contract.events) if isinstance(getattr(dflash_contract.events, name), EventType)}
    assert names == declared
    assert {getattr(dflash_contract.events, name).name for name in declared} == set(dflash_contract.events.TYPES)


def test_docs_events_md_is_what_the_schema_makes():
    assert (REPO / "docs" / "events.md").read_text() == markdown(), \
        "docs/events.md is stale: (cd remote && python -m dflash_contract.events > ../docs/events.md)"
