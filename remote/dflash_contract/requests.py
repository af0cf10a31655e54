"""The agent's verbs as the CLI calls them: each request a frozen dataclass whose `argv()`
is the verb and its options, every value in the option's own word (--name=VALUE) so
that no user value can read as an option (dflash_agent's docstring lists the verbs)."""
import hashlib

# How many bytes before a log offset its fingerprint covers: enough that a log rewritten
# from byte 0 (truncated, then grown past the offset again) shows different bytes there.
FINGERPRINT_BYTES = 64


def fingerprint(data: bytes) -> str:
    """"LEN:SHA256HEX" of `data`, the last bytes before an offset in a log. A follower
    that resumes at the offset (follow --fingerprint) checks that the file still holds
    these bytes there."""
    return "%d:%s" % (len(data), hashlib.sha256(data).hexdigest())
