"""StringTable: strings kept as one UTF-8 blob, read back as the strings they were; and the GGUF
reader's check that every string of an array is UTF-8 on its own."""

import numpy as np
import pytest

from kipp.errors import ArtifactError
from kipp.formats import gguf
from kipp.formats.gguf import ValueType
from kipp.formats.string_table import StringTable, bad_utf8

STRINGS = ["a", "", "Ġthe", "ĠĠ", "語", "🙂 ok", "", "<|im_end|>", "x y", ""]


def test_reads_back_every_string():
    table = StringTable.of(STRINGS)
    assert len(table) == len(STRINGS)
    assert list(table) == STRINGS
    assert [table[i] for i in range(len(STRINGS))] == STRINGS
    assert [table[-i] for i in range(1, len(STRINGS) + 1)] == STRINGS[::-1]
    assert table[np.int64(2)] == "Ġthe"
    assert table[2:6] == tuple(STRINGS[2:6]) and table[::-3] == tuple(STRINGS[::-3])
    assert table.index("語") == 4 and "🙂 ok" in table and "b" not in table
    with pytest.raises(IndexError, match="outside a table of 10"):
        table[10]
    with pytest.raises(IndexError):
        table[-11]
    assert list(StringTable.of([])) == [] and len(StringTable.of([])) == 0


def test_equal_and_hashed_as_the_tuple_it_holds():
    table = StringTable.of(STRINGS)
    assert table == tuple(STRINGS) and table == STRINGS and tuple(STRINGS) == table
    assert table == StringTable.of(tuple(STRINGS))
    assert hash(table) == hash(StringTable.of(STRINGS)) == hash(tuple(STRINGS))
    assert len({table, tuple(STRINGS)}) == 1  # equal, so one member of a set
    # same bytes cut elsewhere, one string changed, one string fewer: all unequal
    for other in (["ab"] + STRINGS[2:], ["b"] + STRINGS[1:], STRINGS[:-1]):
        assert table != StringTable.of(other) and table != tuple(other)
    assert StringTable.of(["ab", ""]) != StringTable.of(["a", "b"])
    assert {table: 1}[StringTable.of(STRINGS)] == 1
    assert StringTable.of(table) is table


def test_refuses_what_is_not_a_table_of_strings():
    with pytest.raises(TypeError, match="holds str, not bytes"):
        StringTable.of(["a", b"b"])
    with pytest.raises(ValueError, match="must end at the blob's length"):
        StringTable(b"abc", np.array([1, 2]))
    with pytest.raises(ValueError, match="must not decrease"):
        StringTable(b"abc", np.array([2, 1, 3]))


def test_bad_utf8_names_the_string():
    ends = np.array([1, 3, 5])
    assert bad_utf8(b"a\xc3\xa9bc", ends) is None
    assert bad_utf8(b"ab\xffcd", ends)[0] == 1  # a byte no UTF-8 has
    assert bad_utf8(b"abc\xc3", np.array([1, 3, 4])) == (2, "unexpected end of data")
    # valid as one text, but the cut falls inside "é": neither piece decodes on its own
    index, reason = bad_utf8(b"a\xc3\xa9b", np.array([2, 4]))
    assert (index, reason) == (1, "starts inside a character")
    assert bad_utf8(b"", np.array([0, 0])) is None


def _gguf_with_strings(path, strings):
    writer = gguf.Writer(path)
    writer.add("test.strings", strings, ValueType.ARRAY, ValueType.STRING)
    with writer:
        pass
    return path


def test_gguf_string_arrays_read_as_tables(tmp_path):
    path = _gguf_with_strings(tmp_path / "s.gguf", STRINGS)
    value = gguf.read(path).value("test.strings")
    assert isinstance(value, StringTable) and value == STRINGS


@pytest.mark.parametrize("patch, index, reason", [
    ({"cd": b"c\xff"}, 1, "invalid start byte"),
    # "b" + "c" become the two bytes of "é", split between the strings
    ({"ab": b"a\xc3", "cd": b"\xa9d"}, 1, "starts inside a character"),
])
def test_gguf_refuses_a_string_that_is_not_utf8(tmp_path, patch, index, reason):
    path = _gguf_with_strings(tmp_path / "s.gguf", ["ab", "cd", "ef"])
    raw = path.read_bytes()
    for old, new in patch.items():
        raw = raw.replace(old.encode(), new)
    path.write_bytes(raw)
    with pytest.raises(ArtifactError) as info:
        gguf.read(path)
    assert info.value.field == f"test.strings[{index}]"
    assert reason in str(info.value)
