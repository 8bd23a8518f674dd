"""A TCP transfer for tests/e2e/test_links.py, run inside a network namespace with `ip netns exec`.

    tcp_transfer.py sink HOST       listen on HOST (any port), print the port, count one connection's bytes until
                                    its sender half-closes, answer the count
    tcp_transfer.py send HOST PORT N  send N bytes, half-close, print the seconds until the count came back
"""

import socket
import sys
import time


def sink(host: str) -> None:
    with socket.create_server((host, 0)) as server:
        print(server.getsockname()[1], flush=True)
        conn, _ = server.accept()
        with conn:
            received = 0
            while data := conn.recv(1 << 16):
                received += len(data)
            conn.sendall(str(received).encode())


def send(host: str, port: int, nbytes: int) -> None:
    with socket.create_connection((host, port), timeout=30) as conn:
        started = time.monotonic()
        conn.sendall(b"x" * nbytes)
        conn.shutdown(socket.SHUT_WR)
        answer = conn.recv(64)
        seconds = time.monotonic() - started
    if int(answer) != nbytes:
        raise SystemExit(f"sent {nbytes} bytes, the sink counted {answer!r}")
    print(seconds, flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "sink":
        sink(sys.argv[2])
    else:
        send(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
