"""Test helper: consume an iterator streamer on a worker thread, as a user would."""
from __future__ import annotations

import threading


def consume_on_a_thread(streamer):
    """Iterates `streamer` on a daemon thread; returns (thread, result dict) where the dict
    gets "parts" (each text piece), then "ended" = True or "error" = what iteration raised."""
    result = {"parts": []}

    def consume():
        try:
            for part in streamer:
                result["parts"].append(part)
            result["ended"] = True
        except BaseException as error:  # noqa: BLE001 - the test inspects it
            result["error"] = error

    thread = threading.Thread(target=consume, daemon=True)
    thread.start()
    return thread, result
