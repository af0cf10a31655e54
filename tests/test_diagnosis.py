"""The line under a failure's traceback (dflash_cli.diagnosis): every signature fed its
failure as the trainer records it (runlog.error_record) of the exception torch, NCCL,
gloo, transformers or the trainer raise, raised here wherever CPU torch can raise it and
otherwise with the exact text their sources write; and a near miss that gets no line."""
from __future__ import annotations

import dataclasses
import re
import socket
import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dflash_cli.diagnosis import Failure, diagnose
from dflash_train.memory import ledger
from dflash_train.config import FaultSpec, load_job_config
from dflash_train.data.batches import load_prompts, tokenize_sample
from dflash_train.data.chat import tokenize_chat
from dflash_train.training.distributed import CollectiveFailed, JoinFailed, PeerFailed
from dflash_train.faults import FaultInjector
from dflash_train.jobs.common import ThreadFailed
from dflash_train.model.objective import DrafterInputs
from dflash_train.runlog import error_record
from dflash_contract.records import ErrorRecord
from dflash_train.data.tiny import ensure_tiny_assets
from dflash_train.compiling.step_build import stray_compile

pytestmark = pytest.mark.timeout(120)
TINY_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "train" / "tiny-cpu.yaml"
GIB = 2**30

# torch's CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp) words an OOM so; CPU
# torch cannot run out of CUDA memory, so its texts are copied.
OOM = ("CUDA out of memory. Tried to allocate 34.80 GiB. GPU 0 has a total capacity of 139.81 GiB of which 7.12 GiB "
       "is free. Including non-PyTorch memory, this process has 131.50 GiB memory in use. Of the allocated memory "
       "126.31 GiB is allocated by PyTorch, and 4.02 GiB is reserved by PyTorch but unallocated. If reserved but "
       "unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid "
       "fragmentation.  See documentation for Memory Management  "
       "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)")
OOM_IN_GRAPH_POOLS = ("CUDA out of memory. Tried to allocate 2.00 MiB. GPU 1 has a total capacity of 47.53 GiB of "
                      "which 896.00 KiB is free. Process 1686436 has 47.51 GiB memory in use. Of the allocated memory "
                      "47.00 GiB is allocated by PyTorch, with 46.22 GiB allocated in private pools (e.g., CUDA "
                      "Graphs), and 149.10 MiB is reserved by PyTorch but unallocated.")
# A kernel launch that fails for memory (cudaErrorMemoryAllocation), torch's wording: no allocator figures.
CUDA_ERROR_OOM = ("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported at some other API "
                  "call, so the stacktrace below might be incorrect.\nFor debugging consider passing "
                  "CUDA_LAUNCH_BLOCKING=1\nCompile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.\n")
# ProcessGroupNCCL.cpp, WorkNCCL::checkTimeout (what a blocking wait raises at its timeout).
NCCL_TIMEOUT = ("[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=12, OpType=ALLREDUCE, "
                "NumelIn=65536, NumelOut=65536, Timeout(ms)=600000) ran for 600017 milliseconds before timing out.")
NCCL_SYSTEM_ERROR = ("NCCL error in: /pytorch/torch/csrc/distributed/c10d/NCCLUtils.cpp:77, unhandled system error "
                     "(run with NCCL_DEBUG=INFO for details), NCCL version 2.21.5\nncclSystemError: System call (e.g. "
                     "socket, malloc) or external library call failed or device error.")
# gloo's, as torch 2.13's all_reduce raised them here between two processes (a peer that
# never joined, one that exited).
GLOO_TIMEOUT = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
                "600000ms for recv operation to complete")
GLOO_CLOSED = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
               "[10.1.2.7]:233. This is typically caused by a remote worker crashing. Check the logs of the remote "
               "worker before reporting an error. GLHF! \U0001f3d6\ufe0f")
# torch 2.11's torch/_inductor/cudagraph_trees.py failing in the second of two threads
# compiled with mode=reduce-overhead, as bench/gpu_threads.py --naive-child raised it on an
# H200 (its last frames; torch 2.13 has no such assertion).
TLS_ASSERTION = '''Traceback (most recent call last):
  File "/opt/torch/.venv/lib/python3.12/site-packages/torch/_inductor/compile_fx.py", line 1875, in run
    return compiled_fn(new_inputs)  # type: ignore[arg-type]
           ^^^^^^^^^^^^^^^^^^^^^^^
  File "/opt/torch/.venv/lib/python3.12/site-packages/torch/_inductor/cudagraph_trees.py", line 436, in deferred_cudagraphify
    fn, out = cudagraphify(model, inputs, new_static_input_idxs, *args, **kwargs)
              ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
  File "/opt/torch/.venv/lib/python3.12/site-packages/torch/_inductor/cudagraph_trees.py", line 494, in cudagraphify
    manager = get_container(device_index).get_tree_manager()
              ^^^^^^^^^^^^^^^^^^^^^^^^^^^
  File "/opt/torch/.venv/lib/python3.12/site-packages/torch/_inductor/cudagraph_trees.py", line 364, in get_container
    container_dict = get_obj(local, "tree_manager_containers")
                     ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
  File "/opt/torch/.venv/lib/python3.12/site-packages/torch/_inductor/cudagraph_trees.py", line 359, in get_obj
    assert torch._C._is_key_in_tls(attr_name)
           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
AssertionError
'''
# A real OOM on an H200 (torch 2.11) after the memory ledger noted a 4 GiB target and a drafter
# with a CUDA graph: the record runlog wrote, message and `memory`.
H200_OOM = ErrorRecord.from_json({"exc_type": "OutOfMemoryError", "traceback": "", "message": (
    "CUDA out of memory. Tried to allocate 200.00 GiB. GPU 0 has a total capacity of 139.80 GiB of which 134.18 GiB "
    "is free. Including non-PyTorch memory, this process has 5.61 GiB memory in use. Of the allocated memory 4.88 GiB "
    "is allocated by PyTorch, with 258.00 MiB allocated in private pools (e.g., CUDA Graphs), and 2.00 MiB is reserved "
    "by PyTorch but unallocated. If reserved but unallocated memory is large try setting "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for Memory Management "
    " (https://docs.pytorch.org/docs/stable/notes/cuda.html#optimizing-memory-usage-with-pytorch-cuda-alloc-conf)"),
    "memory": {"devices": {"cuda:0": {"allocated": 4966057472, "reserved": 5238685696, "max_allocated": 5234496000}},
               "parts": [{"part": "target", "device": "cuda:0", "bytes": 4294967296},
                         {"part": "drafter-0", "device": "cuda:0", "bytes": 671090176},
                         {"part": "drafter-0 CUDA graphs", "device": "cuda:0", "bytes": 270532096}]}})


def caught(action) -> BaseException:
    try:
        action()
    except BaseException as exc:  # noqa: BLE001 - what the action raises is the point
        return exc
    raise AssertionError(f"{action} raised nothing")


def raising(exc: BaseException, cause: BaseException | None = None):
    """A function that raises `exc` (from `cause`, raised first, as a wrapper does)."""
    def action():
        if cause is None:
            raise exc
        try:
            raise cause
        except BaseException as inner:
            raise exc from inner
    return action


def recorded(exc: BaseException, thread: str = "drafter-1") -> ErrorRecord:
    """The errors.jsonl record the trainer writes for `exc`."""
    return error_record(exc, thread=thread, thread_ident=threading.get_ident(), phase="train", step=3)


def line(record: ErrorRecord, host: str = "ct200", hosts: tuple[str, ...] = ()) -> str | None:
    return diagnose(Failure(record, "my run-1", host, hosts))


def test_an_unknown_failure_gets_no_line():
    injector = FaultInjector((FaultSpec(thread="drafter-1", at="startup", kind="raise"),))
    assert line(recorded(caught(lambda: injector.fire("drafter-1")))) is None


def test_a_full_disk_names_its_mount_and_the_resume(tmp_path):
    from dflash_files.diskspace import DiskFull

    exc = DiskFull(str(tmp_path / "checkpoints" / "step_5"), needed=1 << 20, free=4096)
    said = line(recorded(caught(raising(exc, OSError(28, "No space left on device")))))
    assert said.startswith(f"the disk of {exc.detail['mount']} is full (4,096 bytes free while writing "
                           f"{tmp_path / 'checkpoints' / 'step_5'});"), said
    assert said.endswith("then `dflash resume 'my run-1'`")


def test_a_model_neither_cached_nor_downloadable_names_the_hosts_cache(tmp_path, monkeypatch):
    from transformers import AutoConfig

    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty hf home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # as a host without the hub's network fails, at once
    said = line(recorded(caught(lambda: AutoConfig.from_pretrained("Qwen/Qwen3-8B")), thread="target-0"))
    assert said is not None and said.startswith(
        "a model was not in ct200's Hugging Face cache and the hub could not be reached from there"), said
    assert "`dflash launch --dry-run` checks this before a run starts" in said


# -- CUDA out of memory -------------------------------------------------------------------

def test_cuda_oom_says_the_gpu_and_the_sizes_and_without_a_ledger_the_token_budget():
    record = recorded(caught(raising(torch.OutOfMemoryError(OOM))))
    assert record.exc_type == "OutOfMemoryError"
    assert record.memory["devices"] == {}  # CPU torch: no CUDA device ran
    assert line(record) == (
        "CUDA out of memory on GPU 0 (cuda:0) allocating 34.80 GiB: 131.50 GiB of its 139.81 GiB in use by this "
        "process, 7.12 GiB free; lower data.token_budget or data.block_token_budget (the step's activations grow "
        "with them); "
        "`dflash launch --dry-run` prints the memory estimate")


def test_a_real_cuda_oom_record_lists_the_parts_held():
    assert line(H200_OOM) == (
        "CUDA out of memory on GPU 0 (cuda:0) allocating 200.00 GiB: 5.61 GiB of its 139.80 GiB in use by this "
        "process, 134.18 GiB free; this run held there: target 4.0 GiB, drafter-0 640 MiB, drafter-0 CUDA graphs "
        "258 MiB; lower data.token_budget or data.block_token_budget (the step's activations grow with them); "
        "`dflash launch --dry-run` prints the "
        "memory estimate")


def test_cuda_oom_seen_through_the_coordinators_wrapper_carries_the_memory_too():
    oom = torch.cuda.OutOfMemoryError(OOM)  # the same class as torch.OutOfMemoryError
    record = recorded(caught(raising(ThreadFailed("drafter-1 failed: OutOfMemoryError: CUDA out of memory."), oom)),
                      thread="coordinator")
    assert record.exc_type == "ThreadFailed" and record.memory is not None
    assert line(record).startswith("CUDA out of memory on GPU 0 (cuda:0) allocating 34.80 GiB")


def held(part: str, gib: float, device: str = "cuda:0") -> dict:
    return dataclasses.asdict(ledger.Held(part, device, int(gib * GIB)))


@pytest.mark.parametrize("parts, advice", [
    ([held("target", 16), held("drafter-0", 40), held("drafter-1", 40)],
     "its 2 drafters hold most: put fewer drafters on each GPU (devices.drafters), or lower data.token_budget "
     "or data.block_token_budget"),
    ([held("target", 16), held("drafter-0", 10), held("drafter-0 CUDA graphs", 60)],
     "the CUDA graphs' pools hold most: `compile: default` captures none"),
    ([held("target", 60), held("drafter-0", 20)],
     "lower data.token_budget or data.block_token_budget (the step's activations grow with them)"),
    ([held("drafter-0", 50), held("drafter-1", 50, "cuda:1")], "lower data.token_budget"),  # one drafter here
])
def test_cuda_oom_names_what_the_run_held_on_that_gpu_and_the_knob_of_what_held_most(parts, advice):
    record = dataclasses.replace(recorded(caught(raising(torch.OutOfMemoryError(OOM)))),
                                 memory={"devices": {}, "parts": parts})
    here = ", ".join(f"{p['part']} {p['bytes'] / GIB:.1f} GiB" for p in parts if p["device"] == "cuda:0")
    assert f"; this run held there: {here}; {advice}" in line(record)


def test_cuda_oom_without_a_ledger_reads_torchs_own_figure_of_the_graph_pools():
    said = line(recorded(caught(raising(torch.OutOfMemoryError(OOM_IN_GRAPH_POOLS)))))
    assert said.startswith("CUDA out of memory on GPU 1 (cuda:1) allocating 2.00 MiB with 896.00 KiB of its "
                           "47.53 GiB free, 46.22 GiB allocated in CUDA graphs' private pools; the CUDA graphs' pools "
                           "hold most: `compile: default`")


def test_other_out_of_memory_errors_are_not_cuda_oom():
    assert line(recorded(caught(raising(torch.AcceleratorError(CUDA_ERROR_OOM))))) is None
    host = caught(lambda: torch.empty(2**50, dtype=torch.uint8))  # CPU torch's own: can't allocate memory
    assert "can't allocate memory" in str(host) and line(recorded(host)) is None


# -- a compile after start-up -------------------------------------------------------------

@pytest.fixture
def compiled_step():
    """A step compiled for rows of 2 (Dynamo's eager backend: guards without Inductor)."""
    @torch.compile(backend="eager", dynamic=False)
    def step(input_ids):
        return input_ids * 2

    step(torch.ones(2, 768))
    yield step
    torch.compiler.set_stance("default")
    torch._dynamo.reset()


def frames_numbered_alike(text: str | None) -> str | None:
    """Dynamo numbers the frames it compiles per process ("0/0", "3/0"): what else this
    process compiled first is not the test's business."""
    return None if text is None else re.sub(r"\b\d+/\d+\b", "F/N", text)


def test_a_stray_compile_after_ready_names_shape_and_guard_and_is_a_trainer_bug(compiled_step):
    torch.compiler.set_stance("fail_on_recompile")  # what compiling.policy.forbid_compiles sets once ready
    refusal = caught(lambda: compiled_step(torch.ones(1, 768)))
    inputs = DrafterInputs(input_ids=torch.ones(1, 768, dtype=torch.long), features=torch.zeros(1, 768, 8),
                           anchors=torch.zeros(1, 512, dtype=torch.long), anchor_valid=torch.ones(1, 512, dtype=bool),
                           labels=torch.zeros(1, 512, 7, dtype=torch.long), weights=torch.ones(1, 512, 7))
    stray: list[BaseException] = []
    thread = threading.Thread(target=lambda: stray.append(caught(raising(stray_compile(refusal, inputs), refusal))),
                              name="drafter-1")
    thread.start()
    thread.join()
    assert frames_numbered_alike(line(recorded(stray[0]))) == (
        "drafter-1 would compile again after it was ready, for a micro-batch of 1 x 768 tokens with 512 blocks "
        "(guard: F/N: tensor 'input_ids' size mismatch at index 0. expected 2, actual 1): start-up missed a shape "
        "the data makes, a trainer bug: please report it with this traceback; meanwhile `compile: cudagraphs` or "
        "`compile: off` avoid it")


def test_torchs_own_recompile_refusals_are_the_same_trainer_bug(compiled_step):
    torch.compiler.set_stance("fail_on_recompile")
    refused = frames_numbered_alike(line(recorded(caught(lambda: compiled_step(torch.ones(1, 768))))))
    assert refused.startswith("torch.compile would compile step again (guard F/N: tensor 'input_ids' size mismatch "
                              "at index 0. expected 2, actual 1): start-up missed a shape the data makes")
    torch.compiler.set_stance("default")
    with torch._dynamo.config.patch(error_on_recompile=True):
        error = caught(lambda: compiled_step(torch.ones(3, 768)))
    assert type(error).__name__ == "RecompileError"
    assert frames_numbered_alike(line(recorded(error))).startswith("torch.compile would compile step again (guard F/N: "
                                                                   "tensor 'input_ids' "
                                            "size mismatch at index 0. expected 2, actual 3): start-up missed")


@pytest.mark.filterwarnings("ignore:`torch.jit.trace` is deprecated")
def test_a_trace_of_a_compiled_step_is_the_recompile_race_and_jit_is_not(compiled_step):
    raced = caught(lambda: torch.fx.symbolic_trace(lambda x: compiled_step(x) + 1))
    assert "FX to symbolically trace a dynamo-optimized function" in str(raced)
    assert line(recorded(raced)).startswith("torch.compile compiled again while another thread ran the compiled "
                                            "step (a recompile racing between drafter threads): start-up missed")
    jit = caught(lambda: torch.jit.trace(lambda x: compiled_step(x) + 1, torch.ones(2, 768)))
    assert "FX to torch.jit.trace a dynamo-optimized function" in str(jit) and line(recorded(jit)) is None


# -- ranks that went silent ---------------------------------------------------------------

PAIR = ("ct200", "ct202")


def test_a_peer_that_went_silent_is_named_with_its_host_and_the_peer_timeout():
    silent = PeerFailed(1, None, "no sign of life from rank 1 for 30s (killed, or frozen)")  # the watchdog's words
    assert line(recorded(caught(raising(silent))), "ct200", PAIR) == (
        "rank 1 (ct202) went silent (no sign of life from rank 1 for 30s (killed, or frozen)); how it ended: "
        "`dflash fetch-traceback 'my run-1' --host ct202`; distributed.peer_timeout_s is how long a silent rank is "
        "waited for")
    failed = PeerFailed(0, "InjectedFault", "injected fault in drafter-1 at step 3 (the cause is 10 frames deep)")
    assert line(recorded(caught(raising(failed))), "ct202", PAIR) == (
        "rank 0 (ct200) failed first (InjectedFault: injected fault in drafter-1 at step 3 (the cause is 10 frames "
        "deep)); its traceback: `dflash fetch-traceback 'my run-1' --host ct200`")


def test_a_rank_that_could_not_join_points_at_rank_0s_address():
    connect = dist.DistNetworkError("The client socket has timed out after 600000ms while trying to connect to "
                                    "(10.1.2.7, 41873).")
    join = JoinFailed("rank 1 could not join the process group of 2 at 10.1.2.7:41873 within 600s (DistNetworkError: "
                      "The client socket has timed out after 600000ms while trying to connect to (10.1.2.7, 41873).)")
    said = line(recorded(caught(raising(join, connect)), thread="coordinator"), "ct202", PAIR)
    assert said.startswith("rank 1 (ct202) could not reach rank 0's rendezvous at 10.1.2.7:41873 within 600 s")
    assert said.endswith("rank 0's log: `dflash fetch-traceback 'my run-1' --host ct200`; distributed.join_timeout_s "
                         "is the wait")


def collective_failed(cause: BaseException) -> ErrorRecord:
    """The trainer's record of a broken all-reduce no rank recorded a reason for."""
    wrapper = CollectiveFailed(f"the gradient all-reduce with the other 1 rank(s) failed and no rank recorded why "
                               f"({type(cause).__name__}: {str(cause).splitlines()[0]})")
    return recorded(caught(raising(wrapper, cause)), thread="drafter-0")


def test_an_nccl_timeout_names_the_rank_that_never_joined():
    assert line(collective_failed(dist.DistBackendError(NCCL_TIMEOUT)), "ct200", PAIR) == (
        "rank 0 (ct200) waited 600 s for ALLREDUCE, which rank 1 (ct202) never joined: it went silent (hung, or far "
        "slower); look at its host: `dflash fetch-traceback 'my run-1' --host ct202` (with --stacks while it runs); "
        "distributed.timeout_s is how long a collective may take")
    assert line(collective_failed(dist.DistBackendError(NCCL_SYSTEM_ERROR)), "ct200", PAIR) is None


def test_a_gloo_timeout_and_a_closed_connection_name_the_peer():
    assert line(collective_failed(RuntimeError(GLOO_TIMEOUT)), "ct202", PAIR).startswith(
        "rank 1 (ct202) waited 600 s for a collective's recv, which rank 0 (ct200) never joined")
    closed = line(collective_failed(RuntimeError(GLOO_CLOSED)), "ct200", PAIR)
    assert closed.startswith("rank 1 (ct202) at [10.1.2.7] closed its connection in a collective: its process ended")
    assert "`dflash fetch-traceback 'my run-1' --host ct202`" in closed
    # Not a collective's: torch elastic's etcd wait, a socket reset while downloading a model.
    assert line(recorded(caught(raising(TimeoutError("Timed out waiting for etcd server to be ready!"))))) is None
    assert line(recorded(caught(raising(ConnectionResetError(104, "Connection reset by peer"))))) is None


def test_a_store_that_does_not_answer_is_rank_0_gone():
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    unreachable = caught(lambda: dist.TCPStore("127.0.0.1", port, 2, False, timeout=timedelta(seconds=1)))
    assert type(unreachable) is dist.DistNetworkError
    said = line(recorded(unreachable, thread="coordinator"), "ct202", PAIR)
    assert said.startswith(f"the store that rank 0 hosts did not answer (The client socket has timed out after "
                           f"1000ms while trying to connect to (127.0.0.1, {port}).): rank 0 (ct200) is gone")


# -- CUDA-graph trees in threads ------------------------------------------------------------

def test_the_cuda_graph_trees_tls_assertion_points_at_compile_cudagraphs():
    record = ErrorRecord(exc_type="AssertionError", message="", traceback=TLS_ASSERTION)
    assert line(record) == ("torch <= 2.12's CUDA-graph trees (torch.compile mode=reduce-overhead) fail in every "
                            "thread but the first that used them; `compile: cudagraphs` (dflash captures each "
                            "drafter's whole step itself) is the safe path with several drafter threads")
    elsewhere = caught(lambda: torch._assert(False, "an assertion of another function"))
    assert line(recorded(elsewhere)) is None


# -- chat templates -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer(workspace):
    from transformers import AutoTokenizer

    config = load_job_config(TINY_CONFIG)
    assets = ensure_tiny_assets(config.target.tiny, config.data.synthetic, workspace / "cache")
    return AutoTokenizer.from_pretrained(str(assets.target_dir))


CHAT = [{"role": "user", "content": "w1"}, {"role": "assistant", "content": "w2 w3"},
        {"role": "user", "content": "w4"}, {"role": "assistant", "content": "w5"}]
FIX = ("fix the chat template of target.path's tokenizer (chat_template in tokenizer_config.json, or "
       "chat_template.jinja), or give the data as \"text\" rows")


def test_a_template_that_rewrites_earlier_turns_names_the_row_and_the_fix(tokenizer):
    tokenizer = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    # Earlier answers rendered without their content: nothing of the turn is left to learn.
    tokenizer.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }} "
                               "{% if m['role'] != 'assistant' or loop.last %}{{ m['content'] }}{% endif %}"
                               "<|im_end|>{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant {% endif %}")
    error = caught(lambda: tokenize_chat(tokenizer, CHAT, "/data/train.jsonl:17"))
    assert line(recorded(error, thread="coordinator")) == (
        "/data/train.jsonl:17: the chat template does not render turn 1's content in the whole conversation as it "
        "does when the turn ends it, so turn 1's tokens cannot be located; " + FIX)
    # A template's own refusal of a conversation names the row.
    tokenizer.chat_template = "{{ raise_exception('System role not supported') }}"
    error = caught(lambda: tokenize_chat(tokenizer, CHAT, "/data/train.jsonl:5"))
    assert line(recorded(error, thread="coordinator")) == (
        "/data/train.jsonl:5: the target's chat template refuses this conversation (System role not supported); "
        "change the row, or " + FIX)
    tokenizer.chat_template = "{% for m in messages %}<|im_start|>{{ m['role'] }}<|im_end|>{% endfor %}"
    error = caught(lambda: tokenize_chat(tokenizer, CHAT[:2], "/data/train.jsonl:3", truncated=True))
    assert line(recorded(error, thread="coordinator")) == (
        "/data/train.jsonl:3: the chat template does not render the last message's content, which a \"truncated\" "
        "row needs; " + FIX)
    not_the_template = caught(lambda: tokenize_sample({"messages": CHAT[:1], "truncated": True}, tokenizer, 64,
                                                      "/data/train.jsonl:4"))
    assert "'truncated' is true but the last message" in str(not_the_template)
    assert line(recorded(not_the_template, thread="coordinator")) is None


def test_a_tokenizer_without_a_chat_template_names_the_row(tokenizer, tmp_path):
    tokenizer = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    tokenizer.chat_template = None
    prompts = tmp_path / "eval.jsonl"
    prompts.write_text('{"text": "w1"}\n{"messages": [{"role": "user", "content": "w1"}]}\n')
    error = caught(lambda: load_prompts(prompts, tokenizer, 8))
    assert line(recorded(error, thread="coordinator")) == (
        f"{prompts}:2 is a \"messages\" row, and the target's tokenizer has no chat template; " + FIX)
    # transformers' own refusal (job: regenerate renders prompts itself) names no row.
    own = caught(lambda: tokenizer.apply_chat_template(CHAT, tokenize=False))
    assert "tokenizer.chat_template is not set" in str(own)
    assert line(recorded(own, thread="target-0")).startswith("the target's tokenizer has no chat template, which "
                                                              "\"messages\" rows (and job: regenerate's prompts)")
