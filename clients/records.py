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
* :class:`DecodeCache` decodes a payload it has decoded before (the same bytes objects) only once.

One copy is the floor for data that must end up in a fresh tensor (or a fresh bytes object).
``python bench/codec_throughput.py`` (DeiT-S state, 88 MB, 2 shared cores, load 3.7): encode 22.7
-> 17.8 ms, decode 27.4 -> 17.5 ms (medians of 7); the cache saves the decode of the unchanged
weights altogether (one per client thread and federation instead of one per message).
"""
from __future__ import annotations

import io
import math
from collections import OrderedDict
from typing import Mapping

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


def decode_tensor(array: Array) -> torch.Tensor:
    """A writable CPU tensor with the values of a Flower Array (a copy: it owns its memory)."""
    if array.stype == NUMPY_STYPE:
        data = array.data
        stream = io.BytesIO(data)  # shares ``data``: only the header is read through it
        try:
            version = np.lib.format.read_magic(stream)
            if version == (1, 0):
                shape, fortran_order, dtype = np.lib.format.read_array_header_1_0(stream)
                if not fortran_order and not dtype.hasobject and dtype.isnative:
                    count = math.prod(shape)
                    flat = np.frombuffer(data, dtype=dtype, count=count, offset=stream.tell())
                    return torch.from_numpy(flat.reshape(shape).copy())
        except ValueError:  # not an .npy payload numpy can parse: Flower's own decoder decides
            pass
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
