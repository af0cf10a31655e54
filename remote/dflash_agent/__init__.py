"""dflash agent: launches, supervises and reports on runs on a host. Stdlib only.

Shipped in every release as remote/dflash_agent with the launcher remote/agent.py.
The CLI runs it as one argv (quoted once by the transport):

    <python> <workspace>/current/remote/agent.py --workspace <workspace> VERB [options]

(or releases/<id>/remote/agent.py: the release a launch installed, not yet current).

Every verb prints one JSON object on stdout, its reply below (a type of dflash_contract.replies,
whose docstring says what the verb does), and exits 0; on a problem it prints a
replies.ErrorReply instead and exits 2 (1 for kind "internal"). `follow` streams JSON
lines instead (dflash_contract.follow.FOLLOW_MESSAGES), `send-file` and `send-compile-artifacts` raw
bytes (a refusal is the ErrorReply as the one line on stderr, stdout empty). stderr is
free-form; --help goes to stderr too. Every option takes its value in the same word too
(--name=VALUE): the CLI passes user values that way, so none can read as an option.

Verbs
-----
launch -> LaunchReply, with --check-only LaunchCheckReply (launch.py)
    --run-id ID --config PATH [--name NAME] [--resource R]... [--force] [--env KEY=VALUE]...
    [--python EXE] [--stall-after S=300] [--startup-stall-after S=300] [--source-json JSON]
    [--restart-json JSON] [--require-module NAME]... [--require-path KIND:KEY=PATH]...
    [--override KEY=VALUE]... [--release ID] [--rank I --world-size N --master-addr A
    [--master-port P] [--host-names H0,H1,...]] [--check-only]
resume -> ResumeReply, with --check-only ResumeCheckReply (resume.py)
    --run-id ID [--release run|current] [--step N] [--env KEY=VALUE]... [--require-module NAME]...
    [--rank R --world-size W [--master-addr A] [--master-port P] [--host-names H0,H1,...]] [--check-only]
status -> StatusReply
    [--run-id ID [--config]]
stop -> StopReply
    --run-id ID [--grace S=10]
stacks -> StacksReply
    --run-id ID [--timeout S=5]
report -> ReportReply
    --run-id ID [--log-lines N=200]
gpus -> GpusReply
info -> InfoReply
follow -> FOLLOW_MESSAGES, one per line (follow.py)
    --run-id ID [--offset N] [--inode I] [--segment K=0] [--fingerprint LEN:SHA256] [--errors-seen K]
    [--events-offset N=0] [--tail-lines N] [--gpu-interval S=5 (0: none)] [--poll S=0.1]
artifacts -> ArtifactsReply
    --run-id ID [--checkpoint]
send-file -> the file's bytes (artifacts.py)
    --run-id ID --folder F --path P --identity I [--offset N=0]
compile-artifacts -> CompileArtifactsReply
send-compile-artifacts -> the artifacts' bytes (compile_artifacts.py)
    --key K --sha256 S
receive-compile-artifacts -> ReceiveCompileArtifactsReply
    --key K --manifest-json JSON
release-files -> ReleaseFilesReply
    --release-id ID [--path P]...
run-config -> RunConfigReply
    --run-id ID
gc -> GcReply
    [--keep N=0]

Not verbs: gpus.py's `probe`, sent with the few modules it imports (nothing else of
this package) as sources to a loader run with `python -c`, so that it answers on a host
with no release or an older one, answers a replies.HostProbe (`dflash hosts --check`).
host_check.py: `dflash launch` sends it, with the modules it imports, to the same loader
before its deploy, and reads its replies.HostCheck (the fit facts and the verdict of
each preflight check the `launch` verb makes).
"""
