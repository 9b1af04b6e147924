"""What the in-process engine (:class:`server.federation.LocalGrid`) takes from Flower beyond its
public app API, pinned: a Flower upgrade that moves, removes or changes one of these fails here with
the symbol's name, instead of somewhere inside a federated round.

LocalGrid relies on: ``flwr.serverapp.Grid``'s abstract interface (it implements all of it),
``flwr.supercore.run.Run.create_empty``, ``flwr.supercore.task_identity.TaskIdentity`` (a Message
takes its run and source node ids from it), ``flwr.common.constant.SUPERLINK_NODE_ID`` and
``ErrorCode.CLIENT_APP_RAISED_EXCEPTION``, and the constructors of ``Message`` (request and error
reply) and ``Context``.
"""
from __future__ import annotations

import importlib
import inspect
from typing import Any, Callable

import flwr
import pytest

from server.federation import LocalGrid

#: Grid's abstract methods in the Flower line this code was written for, with the parameter names
#: the ServerApp's strategy passes (by keyword, for some of them).
GRID_METHODS = {
    "set_run": ["self", "run"],
    "run": None,  # a property
    "create_message": ["self", "content", "message_type", "dst_node_id", "group_id", "ttl"],
    "get_node_ids": ["self"],
    "push_messages": ["self", "messages"],
    "pull_messages": ["self", "message_ids"],
    "send_and_receive": ["self", "messages", "timeout"],
}


def _resolve(dotted: str) -> Any:
    """``package.module.Attr.attr`` -> the object, importing the longest module prefix."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(dotted)


def _check_run_create_empty() -> None:
    run = _resolve("flwr.supercore.run.Run.create_empty")(run_id=1234)
    assert run.run_id == 1234


def _check_task_identity_feeds_message() -> None:
    from flwr.app import Message, RecordDict

    identity = _resolve("flwr.supercore.task_identity.TaskIdentity")
    node = _resolve("flwr.common.constant.SUPERLINK_NODE_ID")
    saved = (identity._task_id, identity._run_id, identity._node_id)
    try:
        identity.task_id, identity.run_id, identity.node_id = 1, 4321, node
        msg = Message(RecordDict(), 7, "train", ttl=60.0, group_id="1")
    finally:
        identity._task_id, identity._run_id, identity._node_id = saved
    md = msg.metadata
    assert (md.run_id, md.src_node_id, md.dst_node_id, md.message_type, md.group_id) == (4321, node, 7, "train", "1")


def _check_error_reply() -> None:
    from flwr.app import Error, Message, RecordDict

    identity = _resolve("flwr.supercore.task_identity.TaskIdentity")
    code = _resolve("flwr.common.constant.ErrorCode.CLIENT_APP_RAISED_EXCEPTION")
    saved = (identity._task_id, identity._run_id, identity._node_id)
    try:
        identity.task_id, identity.run_id, identity.node_id = 1, 4321, 0
        request = Message(RecordDict(), 7, "train", ttl=60.0, group_id="1")
        reply = Message(Error(code=code, reason="boom"), reply_to=request)
    finally:
        identity._task_id, identity._run_id, identity._node_id = saved
    # The strategy files the failure under the replying node: the request's destination.
    assert reply.has_error() and reply.error.code == code
    assert (reply.metadata.src_node_id, reply.metadata.dst_node_id, reply.metadata.run_id) == (7, 0, 4321)


def _check_context() -> None:
    from flwr.app import Context, RecordDict

    ctx = Context(run_id=0, node_id=5, node_config={"partition-id": 0, "num-partitions": 1}, state=RecordDict(),
                  run_config={"seed": 0})
    ctx.run_id = 99  # LocalGrid.set_run rewrites it
    assert (ctx.run_id, ctx.node_id, ctx.node_config["partition-id"]) == (99, 5, 0)


def _check_grid_interface() -> None:
    grid_cls = _resolve("flwr.serverapp.Grid")
    assert set(grid_cls.__abstractmethods__) == set(GRID_METHODS), (
        f"Grid's abstract methods are now {sorted(grid_cls.__abstractmethods__)}; LocalGrid implements "
        f"{sorted(GRID_METHODS)}")
    for name, params in GRID_METHODS.items():
        if params is not None:
            assert list(inspect.signature(getattr(grid_cls, name)).parameters) == params, name
            assert list(inspect.signature(getattr(LocalGrid, name)).parameters) == params, name
    assert not LocalGrid.__abstractmethods__


def _check_make_message() -> None:
    from flwr.app.message import make_message

    # LocalGrid rebuilds each delivered message from its metadata and a copied content.
    assert list(inspect.signature(make_message).parameters) == ["metadata", "content", "error"]


PINS: dict[str, Callable[[], None]] = {
    "flwr.supercore.run.Run.create_empty": _check_run_create_empty,
    "flwr.supercore.task_identity.TaskIdentity": _check_task_identity_feeds_message,
    "flwr.common.constant.ErrorCode.CLIENT_APP_RAISED_EXCEPTION": _check_error_reply,
    "flwr.app.Context": _check_context,
    "flwr.serverapp.Grid": _check_grid_interface,
    "flwr.app.message.make_message": _check_make_message,
}


@pytest.mark.parametrize("symbol", list(PINS))
def test_flower_internal_used_by_local_grid(symbol: str) -> None:
    try:
        PINS[symbol]()
    except Exception as err:  # any change at all: say which symbol, then the details
        pytest.fail(f"Flower {flwr.__version__} changed {symbol}, which server.federation.LocalGrid relies on: "
                    f"{type(err).__name__}: {err}")
