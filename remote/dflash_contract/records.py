"""What the agent and the trainer write in a run's folder, as the CLI and the agent read
it (docs/layout.md): JSON lines, and which of errors.jsonl's records are one attempt's."""
import json
from typing import Any, Dict, List, Optional


def parse_json_line(line: bytes) -> Optional[Any]:
    """One JSONL record, or None for a line that is not JSON (a torn write)."""
    try:
        return json.loads(line.decode("utf-8"))
    except ValueError:
        return None


def attempt_errors(records: List[Dict[str, Any]], attempt: int) -> List[Dict[str, Any]]:
    """The error records of one attempt of the run (a record without `attempt`, or a line
    that is not JSON, counts as attempt 0's: written before attempts existed)."""
    return [r for r in records if int(r.get("attempt") or 0) == attempt]
