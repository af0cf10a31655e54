"""dflash agent: launches, supervises and reports on runs on a host. Stdlib only.

Shipped in every release as remote/dflash_agent with the launcher remote/agent.py.
The CLI runs it as one argv (quoted once by the transport):

    <python> <workspace>/current/remote/agent.py --workspace <workspace> VERB [options]

(or releases/<id>/remote/agent.py: the release a launch installed, not yet current).

Every verb but `follow`, `send-file` and `send-compile-artifacts` prints exactly one JSON object on stdout and exits 0; on a
problem it prints {"error": "<message>", "kind": "<usage|not_found|conflict|host|internal>"}
and exits 2 (usage/conflict/not_found/host) or 1 (internal); an error may carry more keys
(a lock conflict adds "resource" and "holders": the ids of the runs using it; "hint": what
to do instead, which the CLI shows under the message). Kind "host": the
host was reached but cannot take the request (the trainer's interpreter lacks a
package, a path of the config is missing, no space left: a write that failed for want
of space, in any verb, adds "path", the file it could not write). stderr is free-form;
--help goes to stderr too. Every option takes its value in the same word too
(--name=VALUE): the CLI passes user values that way, so none can read as an option.

Verbs
-----
launch   --run-id ID --config PATH [--name NAME] [--resource R]... [--force]
         [--env KEY=VALUE]... [--python EXE] [--stall-after S=300] [--startup-stall-after S=300]
         [--source-json JSON] [--require-module NAME]... [--require-path KIND:KEY=PATH]... [--override KEY=VALUE]...
         [--restart-json JSON] [--release ID]
         [--rank I --world-size N --master-addr A [--master-port P] [--host-names H0,H1,...]]
         [--check-only]
         First checks what only the host can (preflight.py), all at once, before
         anything of the run exists: at least 64 MiB free in the workspace; each
         --require-module found by the trainer's interpreter (--python, run with the
         trainer's environment); each --require-path, PATH as the trainer resolves it
         (~ expanded, relative to the release root), KEY the config key it came from:
         KIND file (an existing file), jsonl (a file that is not empty or blank and
         whose first row is a JSON object with "text" or "messages": the training
         data), checkpoint (a folder holding state.json) or
         model (a folder holding config.json, or, when no such path exists, a Hugging
         Face hub id such as org/name). Problems -> kind "host" naming each key or
         package and host path. Then creates runs/ID/, copies the config to
         runs/ID/config.yaml (a relative PATH is read from the release root; "-"
         reads the config from stdin), takes the locks
         for its resources (GPU indices as "gpu0", "gpu1", or "cpu" for a CPU-only run;
         a lock lists every run using the resource: while any of them has not ended ->
         kind "conflict" naming them all, unless --force, which adds this run next to
         them; runs that ended are dropped from the list), then starts a supervisor in
         a new session (setsid; stdin /dev/null;
         its own stderr to runs/ID/agent.log). The supervisor forks the trainer in
         another new session, writes run.json (run id, release id, config, argv, pid,
         pgid, process start time, boot id, host, started_at, stall_after,
         startup_stall_after) *before*
         letting the child exec `python -m dflash_train --config runs/ID/config.yaml
         --run-dir runs/ID` with cwd runs/ID, PYTHONPATH=<release>/remote,
         PYTHONUNBUFFERED=1, PYTHONDONTWRITEBYTECODE=1, DFLASH_RUN_ID, DFLASH_RELEASE_ID, DFLASH_RELEASE_DIR (the
         release root), DFLASH_WORKSPACE, the --env pairs, stdout+stderr appended to
         runs/ID/train.log. The release is --release ID (installed in releases/ID,
         else kind "not_found"), which `current` is switched to just before the
         supervisor starts (and put back if it does not: a refused launch leaves
         `current` as it was), or without it the one `current` points to at launch,
         resolved (runs keep their release even when `current` moves on). When the
         trainer ends it writes exit.json {exit_code, signal, oom_killed, ended_at,
         exec_error, attempt, error} atomically (exec_error: null, or why the exec failed;
         exit_code is then 127 and train.log holds the reason; error: null, or that the
         disk had no room for exit.json, which then went into runs/ID/exit.json.reserve's
         room). The supervisor's own failures are `supervisor[PID]: error: …` lines in
         agent.log. With --restart-json
         {"max", "on", "backoff_s"} (run.json's "restart") the supervisor starts the
         next attempt from the newest checkpoint instead, as docs/runs.md "The restart
         policy" says; run.json's "attempt" and "attempts" list the attempts. run.json also records name,
         release_dir, workspace, config_source, cwd, env_keys (the --env keys; values
         are not recorded), resources, start_time (/proc stat field 22) and
         supervisor {pid, start_time} and source: the --source-json object (where the
         release came from, docs/releases.md; null without it), whose "release_id" must name
         the current release, else kind "conflict", and overrides: the --override
         strings in order ([] without any), the `--set KEY=VALUE` the CLI resolved
         the config with, recorded as given (the agent neither reads nor applies them). `launch` returns after run.json exists:
         {"run_id", "run_dir", "pid", "pgid", "release_id"}. A launch that fails before
         run.json exists leaves no run directory and no lock.
         One host's part of a run on several hosts (docs/multihost.md): --rank,
         --world-size and --master-addr go together; the trainer's environment then
         holds RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK=0 and
         LOCAL_WORLD_SIZE=1 (torch.distributed's env://; they override --env and the
         host's own), and run.json "distributed": {"rank", "world_size", "master_addr",
         "master_port", "hosts": --host-names as a list}. Without them these variables
         are removed from the trainer's environment and "distributed" is null.
         --check-only: every check above (the preflight, the run id not taken, no live
         holder of a resource unless --force), nothing created, nothing started:
         {"run_id", "checked": true, "release_id"}, plus "master_port": a TCP port free
         on this host now (bound as port 0) when --master-port is 0 or absent. The CLI
         checks every host this way before it starts any.
resume   --run-id ID [--release run|current] [--step N] [--env KEY=VALUE]... [--require-module NAME]...
         [--rank R --world-size W [--master-addr A] [--master-port P] [--host-names H0,H1,...]] [--check-only]
         The next attempt of a run that ended (docs/runs.md "Attempts"), from its complete
         checkpoint of step N (default: the newest), with its config and its release
         (--release run) or the current one: under a per-run lock, refused (kind
         "conflict") while the run is live (not terminal), when it SUCCEEDED and no --step
         is given ("run ID succeeded at step N; nothing to resume", with a "hint" naming
         `dflash resume ID --step N` and the checkpoints' steps), or when the chosen release's
         `python -m dflash_train.resume_check` says the checkpoint does not fit the config;
         kind "not_found" without a complete checkpoint (or none at N) or when the run's
         release is gone. Then the --require-module check, the run's resources taken as by
         launch, and a new supervisor started as launch starts one, for attempt
         run.json's attempt + 1 (reason "resume", env DFLASH_ATTEMPT, argv + --resume-from
         FOLDER); it writes run.json, appends the attempt markers to events.jsonl and
         train.log, then removes the ended attempt's exit.json and stop_requested.json.
         -> {"run_id", "attempt", "previous_state", "step", "checkpoint", "pid",
             "release_id", "previous_release_id", "release"}
         A part of a run on several hosts (run.json `distributed`) resumes only with its
         --rank and --world-size, which must be run.json's (kind "conflict" otherwise, and
         without them); --master-addr defaults to the launch's, --master-port is the new
         rendezvous port. Rank 0 needs the checkpoint and checks its fit; rank > 0 needs
         --step (rank 0's) and no checkpoint: its trainer gets `--resume-from rank0` and
         takes rank 0's. --check-only checks all that and the resources' locks, starts
         nothing: -> {"run_id", "checked": true, "attempt", "previous_state", "step",
         "checkpoint"}, plus "master_port" (free here now) when --master-port is 0.
status   [--run-id ID [--config]]    {"runs": [RunStatus...]} (all runs if no id; newest first)
         RunStatus = {"run_id", "name", "state", "reason": why a FAILED, LOST or
                      DEGRADED run failed, one line (the latest attempt's first error
                      record "EXC_TYPE: message", else exit.json's error, else the latest
                      supervisor's last error in agent.log) or null, "pid", "started_at", "ended_at",
                      "exit": exit.json or null, "errors": n_records,
                      "last_heartbeat": ts or null, "release_id", "source": run.json's
                      source or null, "overrides": run.json's overrides or [],
                      "step": last step or null (of the latest attempt),
                      "startup": the start-up phase under way before the first step
                      (the newest `startup` event's label while it is "started" or
                      "alive"), or null, "startup_elapsed_s": how long it has been under way,
                      "attempt", "attempts": how many, "resume_step": the checkpoint step
                      the latest attempt started from or null, "checkpoint_step": the
                      newest complete checkpoint's step or null, "peer_failure": the
                      detail {peer_rank, peer_exc_type, peer_message} of the latest
                      attempt's first PeerFailed record (this rank stopped for that
                      peer) or null}
         --config (with --run-id only, else kind "usage") adds "config": run.json's
         config, the text of config.yaml as launched.
         ended_at comes from exit.json, or from the trainer's `done` event when no
         supervisor was left to write exit.json.
stop     --run-id ID [--grace S=10]
         Writes stop_requested.json (which also ends a restart policy's restarting),
         SIGTERM to the trainer's process group, waits `grace`, SIGKILL (and again for
         the group of an attempt that a restart started meanwhile, read from run.json), and returns only when no process of the group is left and
         exit.json exists (or no supervisor is left to write it: the run is then
         STOPPED all the same): {"run_id", "state", "killed": bool}.
stacks   --run-id ID [--timeout S=5]
         Appends a dump header line to faulthandler.log, then SIGUSR1 to the trainer
         (faulthandler dumps all threads there); returns {"run_id", "text": the new
         dump, its threads named from threads.json: "Thread 0x… [drafter-1] (most
         recent call first):"}. Refused (kind "conflict") when the trainer is not
         running or has no SIGUSR1 handler yet, whose default action would kill it.
report   --run-id ID [--log-lines N=200]
         Everything fetch-traceback needs: {"run_id", "state", "run": run.json,
         "exit": exit.json|null, "errors": [records...], "faulthandler": text (its
         last 4 MiB), "last_stacks": its newest dump, "log_tail": last N lines of
         train.log, "agent_error": the latest supervisor's last error in agent.log or
         null}; both stack texts have their threads named. A record line that
         is not JSON is given as {"raw": text}.
gpus     {"gpus": [{"index", "name", "memory_used_mib", "memory_total_mib",
          "utilization_pct", "temperature_c", "power_w"}]} ([] without nvidia-smi;
          plus "problem": text when nvidia-smi exists but fails).
info     {"python", "platform", "hostname", "boot_id", "packages": {"torch": v|null,
          "transformers": v|null}, "gpus": [...], "current_release": id|null,
          "python_executable"} (+ "gpus_problem" as for gpus)
gpus.py --fit-facts [--model=PATH] [--env=KEY=VALUE]...
         Not a verb: gpus.py's source run with `python -c SOURCE WORKSPACE --fit-facts ...`
         (it imports nothing of this package), so `dflash launch` asks it before the
         deploy, on a host with no release or an older one (docs/fit-check.md).
         The --env pairs (the inventory's env) are applied first, as the trainer gets
         them. -> {"gpus": [... as `gpus`] (+ "problem"), "target": the fields of PATH's
         config.json or null, "target_source": the file read | "target_problem": why
         none} ("target" null, nothing else, without --model). PATH: an absolute or ~
         model folder, or a hub id found in the Hugging Face cache (HF_HUB_CACHE,
         HUGGINGFACE_HUB_CACHE, HF_HOME/hub, XDG_CACHE_HOME/huggingface/hub, in that
         order) at refs/main's snapshot, else its newest snapshot holding config.json;
         a hub id not cached is a target_problem (the trainer would download it).
follow   --run-id ID [--offset N] [--inode I] [--segment K=0] [--fingerprint LEN:SHA256]
         [--errors-seen K] [--events-offset N=0] [--tail-lines N] [--gpu-interval S=5 (0: none)]
         [--poll S=0.1]
         Streams JSON lines, flushed one by one, until the run is terminal and
         everything was sent:
           {"t": "log", "offset": start_byte, "data": text}
               (+ "inode": I, "segment": K in the first of a stream and of a segment)
               whole lines only (a partial last line is held until it completes, the
               run ends or the segment ends); data is utf-8 decoded with
               surrogateescape, so data.encode("utf-8", "surrogateescape") gives the
               exact bytes and offset + their length is where the next message starts.
               Lines are batched for up to 1 s (the wire stays near the log's own
               size); the lines before an error record are sent at once, with it.
           {"t": "rotated", "reason": "truncated"|"replaced", "segment": K+1, "inode": I,
            "offset": 0 (or the --tail-lines start), "previous_end": N, "complete": bool}
               train.log was cut in place (copytruncate: a size below what was read,
               or other bytes than those read just before it) or another file took
               its name ("replaced"; followed once it has content: until then the
               old file, which the trainer still writes, is). Everything of the old
               content that could be read was sent before this message, ending at
               previous_end (a last line without newline too); then the new content
               follows from offset 0 as segment K+1. complete: the old content was
               read to its end, from the old file itself or from a copy next to it
               (train.log.*) holding the bytes before the read position; false when
               none was found, so lines written to it after its last read may be
               missing. Lines logrotate's copytruncate loses itself (written between
               its copy and its cut) are lost here too.
           {"t": "error", "index": k, "record": errors.jsonl record}
           {"t": "events", "offset": start_byte, "next": end_byte, "events": [record, ...]}
               events.jsonl's records (step, eval, checkpoint, replicas, phase, ...;
               every type but heartbeat) from byte --events-offset on, whole lines
               only, batched like the log (up to 1 s or 64 KiB); [offset, next) is the
               stretch of the file they come from, so a resume passes next as
               --events-offset. A stretch of heartbeats alone sends nothing; a line
               that is not JSON (a write cut by a kill) is skipped.
           {"t": "gpu", "ts": ..., "gpus": [...]}          (none without nvidia-smi)
           {"t": "state", "state": "RUNNING", "ts": ...}    on every state change
           {"t": "end", "state": "FAILED", "exit": exit.json|null, "attempt": the latest
            attempt (whose error records the outcome is), "offset": N, "segment": K}
         An error line that is not JSON comes as {"t": "error", "index", "record":
         null, "raw": text}.
         When the reader goes away (EPIPE, or its pipe reports an error even while
         the run is quiet) follow exits 0 without a word; the run goes on.
         --tail-lines N starts at the last N lines (found by reading backwards from the
         end, so the cost does not depend on the log's size): of the file a resume
         found, or of the new one after "rotated"; --errors-seen skips records
         already received.
         Resuming: --offset N --inode I --segment K --fingerprint F, where F is
         jsonio.fingerprint of the (at most 64) bytes received just before N. The
         stream goes on at N in segment K when the file with inode I (train.log, or
         renamed to train.log.*) is at least N long and holds those bytes there. If
         not, the content the client stopped in is gone: the rest of it is sent from
         a copy that holds those bytes, if any, then "rotated" to segment K+1 and the
         current train.log from 0. So a reconnect neither replays nor splices: (inode,
         offset) alone cannot tell a log cut and grown back past N from the old one.
         Segment numbers are the client's: a fresh stream starts at --segment.
artifacts --run-id ID [--checkpoint]
         What `dflash pull` fetches: {"run_id", "state", "folders": [{"folder": "export"
         or "checkpoints/step_000100", "files": [{"path", "size", "sha256", "identity"}],
         "hashed_on_host": [path...]}]}: export/ and, with --checkpoint, the step folder
         checkpoints/latest names now. Regular files, sorted by path, SHA256SUMS
         included, read through one open descriptor of the folder, so the listing is of
         one version even while the trainer replaces the folder. sha256 comes from the
         folder's SHA256SUMS (the trainer writes it after the folder's other files), else
         it is computed now (those paths are in hashed_on_host). identity is
         "dev:inode:size:mtime_ns". A run without export/ (or, with --checkpoint,
         without a checkpoint) -> kind "not_found", naming the run's state.
send-file --run-id ID --folder F --path P --identity I [--offset N=0]
         The raw bytes of F/P from byte N to its end on stdout, nothing else. Refused
         before any byte is sent, with the error object as the one line on stderr and
         stdout empty: kind "conflict" when the file is gone or its identity is no longer
         I (the folder was replaced since the listing: list again); "usage" for F other
         than export or checkpoints/<one name>, a P leading out of F, or N past the end.
         The bytes are read through the descriptor opened for the check, so a folder
         replaced while they flow does not mix two versions.

compile-artifacts
         The portable compile artifacts of the workspace's compile cache
         (cache/compile/<key>/artifacts.bin + artifacts.json, docs/layout.md):
         {"gpus": [the host's GPU names, as `gpus` gives them], "cpu": /proc/cpuinfo's model
         name or null, "artifacts": [{"key", "facts": {gpu,
         torch, triton, cuda, python}, "size", "sha256", "torch", "saved_at"}]}, sorted by
         key; a key folder whose manifest is unreadable or names another size than its
         artifacts.bin is left out. sha256 is the manifest's (receivers check the bytes).
send-compile-artifacts --key K --sha256 S
         Key K's artifacts.bin, raw on stdout, nothing else. Refused before any byte, the
         error object as the one line on stderr: kind "not_found" when K has no listed
         artifacts, "conflict" when their manifest names other bytes than S (list again).
receive-compile-artifacts --key K --manifest-json JSON
         Stores the bytes on stdin as key K's artifacts, all or nothing: written to a temp
         file in the key folder, fsynced, checked against the manifest's size and sha256,
         renamed to artifacts.bin, then the manifest (JSON, as listed) written atomically.
         Kind "usage" when the manifest's facts do not make K (compile_artifacts.compile_key,
         the trainer's rule) or the bytes do not match it; "conflict" when K's key.json
         holds other facts. -> {"key", "size", "sha256", "received": true}
release-files --release-id ID [--path P]...
         {"release_id", "manifest": releases/ID/MANIFEST's text, "files": {P: base64 of
         its bytes}, "too_large": [P over 8 MiB, not sent]}. Only paths MANIFEST lists
         (else kind "usage"); a release not in releases/ -> kind "not_found".
run-config --run-id ID
         {"run_id", "config": runs/ID/config.yaml's text}.
gc       [--keep N=0]
         Removes releases/<id> folders that are not `current` and that no runs/*/run.json
         names as release_id, beyond the N newest (mtime) of them, made writable first.
         Holds .deploy.lock meanwhile, taken without waiting: while a deploy installs,
         kind "conflict". {"removed": [{"release_id", "bytes"}], "kept": [{"release_id",
         "reason"}], "freed_bytes"}.

Run states (docs/runs.md "Run states"): STARTING, RUNNING, SUCCEEDED, FAILED, STOPPED, DEGRADED,
STALLED, LOST, derived from run.json + exit.json + errors.jsonl + stop_requested.json
+ events.jsonl (heartbeats, and the trainer's `done` when no exit.json was written)
+ /proc, never from the end of a stream. LOST only when no process is left and nobody
recorded how the run ended.
"""
