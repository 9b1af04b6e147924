"""Torch state dicts <-> Flower ArrayRecords with one copy of the data each way.

Why not Flower's own ``ArrayRecord(state_dict)`` and ``record.to_torch_state_dict()``: they run
``np.save`` / ``np.load`` on a ``BytesIO``, which copies every tensor two or three times (numpy's
reader copies 256 KiB chunks in a Python loop). Every message of the paper protocol carries a
DeiT-S state or gradient (22 M float32, 88 MB): the server decodes every reply, every client decodes
the weights it gets and encodes its reply. Here:

* :func:`encode_state` writes exactly the bytes ``np.save`` writes (the format-1.0 ``.npy`` header,
  then the C-order data) with one copy: any Flower decoder reads them, and the simulation engine
  serialises them unchanged;
* :func:`decode_state` parses the ``.npy`` header and copies the data once into a fresh, writable
  tensor (nothing aliases the message's immutable bytes). What it cannot read that way (another
  serialisation type, a Fortran-order, non-native or object array, a version-2 header) goes through
  Flower's own ``Array.numpy()``;
* :class:`DecodeCache` decodes a payload it has decoded before (the same bytes objects) only once;
* :class:`LazyState` is a reply as the server keeps it: checked on read-only views of the message's
  bytes (no copy) and each array copied into a tensor only when something reads it. In the paper
  protocol the closed-form attack and the top-1 read-out read 3 of a DeiT-S gradient's 150 arrays
  (~2 MB of 88 MB), so the server does not copy every reply (15-19 ms each).

One copy is the floor for data that must end up in a fresh tensor (or a fresh bytes object).
``python bench/codec_throughput.py`` (DeiT-S state, 88 MB, 2 shared cores, load 3.7): encode 22.7
-> 17.8 ms, decode 27.4 -> 17.5 ms (medians of 7); the cache saves the decode of the unchanged
weights altogether (one per client thread and federation instead of one per message).
"""
from __future__ import annotations

import io
import math
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import Optional

import numpy as np
import torch
from flwr.app import Array, ArrayRecord

#: Flower's serialisation type of numpy arrays (``flwr.common.constant.SType.NUMPY``).
NUMPY_STYPE = "numpy.ndarray"


def encode_tensor(tensor: torch.Tensor) -> Array:
    """A Flower Array of ``tensor`` (CPU, any shape) whose ``data`` equals ``np.save``'s output."""
    arr = tensor.detach().cpu().numpy()
    if not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr)
    header = io.BytesIO()
    try:
        np.lib.format.write_array_header_1_0(header, np.lib.format.header_data_from_array_1_0(arr))
    except ValueError:  # a header too long for format 1.0: np.save's own choice of version
        return Array.from_numpy_ndarray(arr)
    # join copies the array's buffer straight into the new bytes object: the one copy.
    data = b"".join((header.getvalue(), arr.reshape(-1).view(np.uint8)))
    return Array(dtype=str(arr.dtype), shape=tuple(arr.shape), stype=NUMPY_STYPE, data=data)


#: Parsed ``.npy`` headers by their bytes: a model's replies repeat the same ~150 headers every
#: round, and numpy parses each with ``ast.literal_eval`` (~45 us, 7 ms per DeiT-S reply).
_HEADERS: dict[bytes, Optional[tuple[tuple[int, ...], np.dtype]]] = {}
_HEADERS_MAX = 4096
_NPY_V1 = b"\x93NUMPY\x01\x00"
_UNSEEN = object()


def npy_view(array: Array) -> Optional[np.ndarray]:
    """A read-only ndarray over a Flower Array's bytes (no copy), or None where its payload is not
    a C-order, native-endian, format-1.0 ``.npy`` of plain values (then only Flower's decoder reads it).

    Raises:
        ValueError: the header is malformed or promises more data than the payload holds.
    """
    if array.stype != NUMPY_STYPE:
        return None
    data = array.data
    if not isinstance(data, bytes) or data[:8] != _NPY_V1 or len(data) < 10:
        return None
    end = 10 + int.from_bytes(data[8:10], "little")
    header = data[:end]
    layout = _HEADERS.get(header, _UNSEEN)
    if layout is _UNSEEN:
        stream = io.BytesIO(header)
        np.lib.format.read_magic(stream)
        shape, fortran_order, dtype = np.lib.format.read_array_header_1_0(stream)
        plain = not fortran_order and not dtype.hasobject and dtype.isnative
        layout = (tuple(shape), dtype) if plain else None
        if len(_HEADERS) >= _HEADERS_MAX:  # bounded: replies are untrusted input
            _HEADERS.clear()
        _HEADERS[header] = layout
    if layout is None:
        return None
    shape, dtype = layout
    return np.frombuffer(data, dtype=dtype, count=math.prod(shape), offset=end).reshape(shape)


def decode_tensor(array: Array) -> torch.Tensor:
    """A writable CPU tensor with the values of a Flower Array (a copy: it owns its memory)."""
    try:
        view = npy_view(array)
    except ValueError:  # not an .npy payload numpy can parse: Flower's own decoder decides
        view = None
    if view is not None:
        return torch.from_numpy(view.copy())
    arr = array.numpy()
    if not arr.dtype.isnative:  # torch takes native byte order only
        arr = arr.astype(arr.dtype.newbyteorder("="))
    return torch.from_numpy(np.ascontiguousarray(arr))


def encode_state(state: Mapping[str, torch.Tensor]) -> ArrayRecord:
    """ArrayRecord of a state dict or gradients, in the dict's order (what ``ArrayRecord(state)`` holds)."""
    return ArrayRecord(OrderedDict((name, encode_tensor(tensor)) for name, tensor in state.items()))


def decode_state(record: ArrayRecord) -> "OrderedDict[str, torch.Tensor]":
    """Name -> writable CPU tensor, in the record's order (what ``record.to_torch_state_dict()`` gives)."""
    return OrderedDict((name, decode_tensor(array)) for name, array in record.items())


class DecodeCache:
    """:func:`decode_state` that returns the previous result for the very same payload.

    The paper protocol's server sends one fixed model (FedSGD with a zero step resends the record
    it sent before), so a client thread and the server would decode the same 88 MB every round. The
    key is the identity of every array's ``data`` bytes, held strongly so that no id can be reused:
    bytes are immutable, so the same objects mean the same values, and a record whose data was
    replaced (or a new message) is decoded afresh. Callers must not modify the returned tensors.
    """

    def __init__(self) -> None:
        self._key: tuple = ()
        self._state: "OrderedDict[str, torch.Tensor]" = OrderedDict()

    def __call__(self, record: ArrayRecord) -> "OrderedDict[str, torch.Tensor]":
        key = tuple((name, array.data) for name, array in record.items())
        same = bool(key) and len(key) == len(self._key) and all(
            n == m and d is e for (n, d), (m, e) in zip(key, self._key))
        if not same:
            self._state, self._key = decode_state(record), key
        return self._state


class LazyState(Mapping[str, torch.Tensor]):
    """Name -> tensor of an ArrayRecord, each array decoded (one copy, :func:`decode_tensor`) the
    first time it is read and kept; :meth:`view` reads an array without copying it.

    The server checks every reply on views and hands it on as this mapping: what nobody reads is
    never copied. Once an array is decoded its bytes are let go, so a mapping read in full holds
    about one copy of the reply, as a decoded dict would. Reads from several threads are safe (a
    race decodes an array twice, equal values), and so is pickling while another thread reads.
    Returned tensors are shared: do not modify them. Pickles lazily (a Ray worker gets the bytes
    and decodes what it reads).
    """

    def __init__(self, record: Mapping[str, Array]) -> None:
        # Snapshots of the Arrays (their bytes are immutable): whatever later reassigns a field of
        # the message's Arrays, this mapping keeps the values as received.
        self._raw: dict[str, Optional[Array]] = OrderedDict(
            (name, Array(dtype=a.dtype, shape=tuple(a.shape), stype=a.stype, data=a.data))
            for name, a in record.items())
        self._tensors: dict[str, torch.Tensor] = {}
        # Guards the hand-over of an array from _raw to _tensors, so that a pickle taken by one
        # thread while another reads sees each array in exactly one of them.
        self._lock = threading.Lock()

    def __getitem__(self, name: str) -> torch.Tensor:
        tensor = self._tensors.get(name)
        if tensor is not None:
            return tensor
        with self._lock:
            tensor = self._tensors.get(name)
            if tensor is not None:
                return tensor
            array = self._raw[name]  # KeyError for an unknown name; None only once decoded
        decoded = decode_tensor(array)  # the copy runs outside the lock; a race decodes twice
        with self._lock:
            tensor = self._tensors.setdefault(name, decoded)
            self._raw[name] = None
        return tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self._raw)

    def __len__(self) -> int:
        return len(self._raw)

    def __contains__(self, name: object) -> bool:
        return name in self._raw

    def view(self, name: str) -> np.ndarray:
        """The values of ``name`` as an ndarray: a read-only view of the message's bytes where the
        array is not decoded yet and its payload allows one, else the decoded tensor's memory.

        Raises:
            KeyError: no such name. ValueError: a malformed payload.
        """
        array = self._raw[name]
        view = None if array is None else npy_view(array)
        return view if view is not None else self[name].numpy()

    def __reduce__(self):
        with self._lock:  # a consistent snapshot while other threads read
            return _rebuild_lazy, (OrderedDict(self._raw), dict(self._tensors))


def _rebuild_lazy(raw: dict, tensors: dict) -> LazyState:
    state = LazyState({})
    state._raw, state._tensors = OrderedDict(raw), dict(tensors)
    return state
