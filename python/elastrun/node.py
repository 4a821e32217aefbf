"""The node endpoint's client: requests to this node's elastrun agent (docs/launcher.md, "The node
endpoint"). One request per connection, one JSON object per line each way; a reply may carry one
file descriptor (SCM_RIGHTS), e.g. a memory checkpoint segment. The C++ twin is
<elastrun/worker/node.hpp>.

    reply, fd = elastrun.node.request("status")
"""

import json
import os
import socket
from typing import Any, Optional, Tuple

from . import _contract

MAX_LINE = 64 * 1024


def address_from_environment() -> str:
    """This worker's agent ($ELASTRUN_NODE_SOCKET); "" when not started by elastrun."""
    return os.environ.get(_contract.ENV_NODE_SOCKET, "")


def _socket_address(address: str) -> str:
    if not address or len(address) > 107:
        raise ValueError(f"node endpoint address {address!r} is empty or longer than 107 bytes")
    return "\0" + address[1:] if address.startswith("@") else address


def request(op: str, address: Optional[str] = None, timeout: float = 5.0,
            **fields: Any) -> Tuple[dict, Optional[int]]:
    """Sends {"v":..,"op":op,**fields} and returns (reply, fd): the reply object and the descriptor
    that came with it (the caller owns and closes it), or None. Raises OSError naming the address
    when no agent answers, RuntimeError when the reply is not JSON."""
    address = address if address is not None else address_from_environment()
    if not address:
        raise OSError(f"no elastrun agent: ${_contract.ENV_NODE_SOCKET} is not set")
    body = {"v": _contract.NODE_PROTOCOL_VERSION, "op": op, **fields}
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        try:
            s.connect(_socket_address(address))
        except OSError as e:
            raise OSError(e.errno, f"no elastrun agent answers at {address}: {e.strerror}") from None
        s.sendall((json.dumps(body) + "\n").encode())
        data, fd = b"", None
        while b"\n" not in data and len(data) <= MAX_LINE:
            chunk, fds, _, _ = socket.recv_fds(s, 4096, 1)
            for extra in fds:
                if fd is None:
                    fd = extra
                else:
                    os.close(extra)
            if not chunk:
                break
            data += chunk
    try:
        reply = json.loads(data.split(b"\n", 1)[0])
    except ValueError:
        if fd is not None:
            os.close(fd)
        raise RuntimeError(f"{address} replied with something else than JSON") from None
    if not isinstance(reply, dict):
        if fd is not None:
            os.close(fd)
        raise RuntimeError(f"{address} replied with something else than a JSON object")
    return reply, fd
