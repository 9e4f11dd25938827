"""What a test starts in place of a `dist-infer` command the zygote (tests/support/zygote.py) runs.

`python -E -S zygote_client.py SOCKET CMD...` is a few milliseconds of start-up: it hands the zygote
its argv, environment, working directory and its stdin/stdout/stderr, forwards the signals it gets
to the forked command, and ends as the command ended (its exit code, or killed by the same signal).
So the test sees a subprocess.Popen that behaves as the command would, pipes and all. Only the
standard library, and nothing of the package: it must start before anything is imported.
"""

import json
import os
import signal
import socket
import struct
import sys

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def _send_request(conn: socket.socket, argv: list) -> None:
    body = json.dumps({"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
    socket.send_fds(conn, [struct.pack("!I", len(body)) + body], [0, 1, 2])


def _read_line(stream) -> dict:
    line = stream.readline()
    if not line:
        sys.stderr.write("zygote_client: the zygote went away before the command ended\n")
        os._exit(1)
    return json.loads(line)


def _end_as(code: int) -> None:
    """Exit with the command's code, or die of the signal that killed it (returncode -N)."""
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code if code >= 0 else 128 - code)


def main() -> None:
    sock_path, argv = sys.argv[1], sys.argv[2:]
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(sock_path)
    _send_request(conn, argv)
    replies = conn.makefile("r")
    pid = _read_line(replies)["pid"]

    def forward(signum, _frame):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for signum in FORWARDED:
        signal.signal(signum, forward)
    _end_as(int(_read_line(replies)["exit"]))


if __name__ == "__main__":
    main()
