"""The gguf package's reader, made to check tensor extents and to leave metadata arrays unparsed.

gguf's reader turns every item of every metadata array into numpy arrays of its own as it opens
the file: for a vocabulary (tokens, merges, token types: tens of thousands each) hundreds of
thousands of small objects, most of the memory and the time of opening the file, on every rank,
though only the front end builds a tokenizer from them. Here an array is parsed only as far as
its end (one pass over its string lengths), and `ArrayField.contents()` decodes it when asked;
the model-loading path never asks.
"""

from __future__ import annotations

import functools
import struct
from typing import Any

import numpy as np

from dist_infer.models.gguf.checks import check_tensor_extent


class ArrayField:
    """A metadata array, decoded on demand: `contents()` gives the list gguf's ReaderField would."""

    def __init__(self, data, name: str, offset: int, start: int, count: int, item_type, order: str):
        from gguf import GGUFValueType

        self._data, self.name, self.offset = data, name, offset
        self._start, self._count, self._order = start, count, order
        self.types = [GGUFValueType.ARRAY, item_type]
        self.end = start + count * self._item_size() if item_type != GGUFValueType.STRING else self._scan()

    def __len__(self) -> int:
        return self._count

    def _item_size(self) -> int:
        return np.dtype(_scalar_dtype(self.types[1])).itemsize

    def _strings(self):
        """(start, length) of each string's bytes, in order; checked against the end of the file."""
        buf, offs, size = self._data, self._start, len(self._data)
        unpack = struct.Struct(f"{self._order}Q").unpack_from
        for i in range(self._count):
            if offs + 8 > size:
                raise ValueError(f"metadata array {self.name}: item {i} starts past the end of the file")
            (n,) = unpack(buf, offs)
            if n > size - offs - 8:
                raise ValueError(f"metadata array {self.name}: item {i} claims {n} bytes, past the end of the file")
            yield offs + 8, n
            offs += 8 + n

    def _scan(self) -> int:
        end = self._start
        for at, n in self._strings():
            end = at + n
        return end

    def contents(self, index_or_slice: Any = slice(None)) -> Any:
        from gguf import GGUFValueType

        if self.types[1] == GGUFValueType.STRING:
            buf = memoryview(self._data)
            items = [str(buf[at : at + n], encoding="utf-8") for at, n in self._strings()]
        else:
            dtype = np.dtype(_scalar_dtype(self.types[1])).newbyteorder(self._order)
            items = np.frombuffer(self._data, dtype, self._count, self._start).tolist()
        return items[index_or_slice]


def _scalar_dtype(value_type):
    import gguf

    dtype = gguf.GGUFReader.gguf_scalar_to_np.get(value_type)
    if dtype is None:
        raise ValueError(f"a metadata array of {value_type!r} items, which are not numbers")
    return dtype


@functools.cache
def lean_reader_class():
    """gguf's reader class, with tensor extents checked before a tensor is mapped and arrays left as ArrayFields."""
    import gguf  # a core dependency, imported on use: importing it is slow
    from gguf import GGUFValueType

    class LeanReader(gguf.GGUFReader):
        def _build_tensors(self, start_offs: int, fields: list) -> None:
            for f in fields:
                _, name, _, dims, type_id, offset = f.parts
                check_tensor_extent(
                    bytes(name).decode("utf-8", "replace"),
                    [int(d) for d in dims],
                    int(type_id[0]),
                    int(start_offs) + int(offset[0]),
                    len(self.data),
                )
            super()._build_tensors(start_offs, fields)

        def _build_fields(self, offs: int, count: int) -> int:
            for _ in range(count):
                orig_offs = offs
                klen, kdata = self._get_str(offs)
                offs += int(klen.nbytes + kdata.nbytes)
                raw_type = self._get(offs, np.uint32)
                offs += int(raw_type.nbytes)
                name = str(bytes(kdata), encoding="utf-8")
                if GGUFValueType(raw_type[0]) == GGUFValueType.ARRAY:
                    field = self._array_field(name, orig_offs, offs)
                    if field is not None:
                        self._push_field(field, skip_sum=True)
                        offs = field.end
                        continue
                size, parts, idxs, types = self._get_field_parts(offs, raw_type[0])
                self._push_field(
                    gguf.ReaderField(orig_offs, name, [klen, kdata, raw_type, *parts], [i + 3 for i in idxs], types),
                    skip_sum=True,
                )
                offs += size
            return offs

        def _array_field(self, name: str, orig_offs: int, offs: int):
            """An ArrayField for an array of strings or numbers at `offs`; None for an array of arrays (gguf parses it)."""
            item_type = GGUFValueType(self._get(offs, np.uint32)[0])
            count = int(self._get(offs + 4, np.uint64)[0])
            start = offs + 12
            if item_type == GGUFValueType.ARRAY:
                return None
            least = 8 if item_type == GGUFValueType.STRING else np.dtype(_scalar_dtype(item_type)).itemsize
            if count > (len(self.data) - start) // least:
                raise ValueError(f"metadata array {name} claims {count} items, more than the file holds")
            order = "<" if self.endianess == gguf.GGUFEndian.LITTLE else ">"
            return ArrayField(self.data, name, orig_offs, start, count, item_type, order)

    return LeanReader
