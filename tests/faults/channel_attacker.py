"""A hostile channel client, as a separate process that the test runs as another uid
(``daemon_proc.as_user``). Reads a JSON plan on stdin, prints one line ``result {json}``.

Plan: ``{"socket": PATH, "name": IDENTITY NAME, "value": V, "channels": [NAME, ...],
"bypass_checks": bool}``: publishes the artifact ``faultkit.publish(client, name, value, 4096)``
would (already present: no bytes staged) once per channel name, each pointing that channel at
it, and counts the outcomes (``ok`` or the error code and ``details.reason``/``role``).
``bypass_checks``: the client library's own name check is switched off first, so that hwrd's
check is what refuses a bad name (as a client of its own making would see).
"""

from __future__ import annotations

import json
import sys
from typing import Any

import faultkit

import hwr.client.publisher
from hwr.client import ArtifactIdentity, connect
from hwr.client.errors import HwrError


def main() -> int:
    plan = json.loads(sys.stdin.read())
    if plan.get("bypass_checks"):
        hwr.client.publisher.check_channel_name = lambda name: name  # type: ignore[assignment]
    tensors = faultkit.tensors(int(plan["value"]), 4096)
    outcomes: dict[str, int] = {}
    per_channel: dict[str, Any] = {}
    with connect(plan["socket"], timeout=30) as client:
        for channel in plan["channels"]:
            try:
                client.publish(ArtifactIdentity.simple(plan["name"]), tensors, channel=channel)
                outcome = "ok"
            except HwrError as exc:
                outcome = f"{exc.code}:{exc.details.get('reason') or exc.details.get('role') or ''}"
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
            per_channel[channel] = outcome
    print("result " + json.dumps({"outcomes": outcomes, "channels": per_channel}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
