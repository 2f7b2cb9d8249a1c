// A GGUF file's string arrays (a vocabulary, its merges) as Python strings in one C call each
// (models/gguf_file.py; a Python loop is the fall-back and the reference the tests hold this to).
//
// A loop in Python spends ~1 µs a string on the length, the slice and the decode: 0.10 s for the
// ~98,000 strings of a 49k vocabulary and its merges, a quarter of a small model's load. Here the
// same work is a call of PyUnicode_DecodeUTF8 per string, with the GIL held (it makes Python objects).
//
//   read_strings(buffer, pos, count) -> (list[str], end): `count` strings from byte `pos` of `buffer`
//       (a contiguous 1-D buffer), each a little-endian uint64 length and that many bytes, decoded as
//       UTF-8 with errors replaced (Python's str(b, "utf-8", "replace")); ValueError where one runs
//       past the end, or where `count` lengths alone would (a corrupt header), before allocating
//   split_pairs(strings) -> list[tuple[str, ...]]: each string of a sequence split at every " "
//       (str.split(" ")), a merge "a b" becoming ("a", "b") without a Python call per merge

#include <Python.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <cstring>

namespace py = pybind11;

namespace {

py::tuple read_strings(const py::buffer& data, int64_t pos, uint64_t count) {
  const py::buffer_info info = data.request();
  if (info.ndim != 1 || info.strides[0] != info.itemsize)
    throw py::value_error("read_strings: the buffer must be contiguous and one-dimensional");
  const auto* base = static_cast<const uint8_t*>(info.ptr);
  const int64_t size = info.size * info.itemsize;
  if (pos < 0 || pos > size) throw py::value_error("read_strings: position outside the buffer");
  if (count > static_cast<uint64_t>(size - pos) / 8) throw py::value_error("string runs past the end of the file");
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(count));
  if (list == nullptr) throw py::error_already_set();
  py::object owner = py::reinterpret_steal<py::object>(list);  // freed on every error below
  for (Py_ssize_t i = 0; i < static_cast<Py_ssize_t>(count); ++i) {
    if (pos + 8 > size) throw py::value_error("string runs past the end of the file");
    uint64_t n;
    std::memcpy(&n, base + pos, 8);  // little-endian hosts only (x86-64, arm64): as the numpy reader
    pos += 8;
    if (n > static_cast<uint64_t>(size - pos)) throw py::value_error("string runs past the end of the file");
    PyObject* s = PyUnicode_DecodeUTF8(reinterpret_cast<const char*>(base + pos), static_cast<Py_ssize_t>(n), "replace");
    if (s == nullptr) throw py::error_already_set();
    PyList_SET_ITEM(list, i, s);
    pos += static_cast<int64_t>(n);
  }
  return py::make_tuple(owner, pos);
}

py::list split_pairs(const py::object& strings) {
  // a tuple of our own: its items stay alive whatever runs while we allocate
  PyObject* items = PySequence_Tuple(strings.ptr());
  if (items == nullptr) throw py::error_already_set();
  py::object items_owner = py::reinterpret_steal<py::object>(items);
  const Py_ssize_t count = PyTuple_GET_SIZE(items);
  PyObject* out = PyList_New(count);
  if (out == nullptr) throw py::error_already_set();
  py::object owner = py::reinterpret_steal<py::object>(out);
  for (Py_ssize_t i = 0; i < count; ++i) {
    PyObject* item = PyTuple_GET_ITEM(items, i);
    if (!PyUnicode_Check(item)) throw py::type_error("split_pairs: every item must be a str");
    const Py_ssize_t n = PyUnicode_GET_LENGTH(item);
    const Py_ssize_t space = PyUnicode_FindChar(item, ' ', 0, n, 1);
    if (space == -2) throw py::error_already_set();
    PyObject* t;
    const Py_ssize_t second = space >= 0 ? PyUnicode_FindChar(item, ' ', space + 1, n, 1) : -1;
    if (second == -2) throw py::error_already_set();
    if (space >= 0 && second == -1) {
      // the usual merge: one space, two pieces (copied from the string's own code points)
      PyObject* a = PyUnicode_Substring(item, 0, space);
      PyObject* b = a == nullptr ? nullptr : PyUnicode_Substring(item, space + 1, n);
      t = b == nullptr ? nullptr : PyTuple_Pack(2, a, b);
      Py_XDECREF(a);
      Py_XDECREF(b);
    } else {  // no space, or several: exactly what str.split(" ") gives
      PyObject* parts = PyUnicode_Split(item, py::str(" ").ptr(), -1);
      t = parts == nullptr ? nullptr : PyList_AsTuple(parts);
      Py_XDECREF(parts);
    }
    if (t == nullptr) throw py::error_already_set();
    PyList_SET_ITEM(out, i, t);
  }
  return py::reinterpret_borrow<py::list>(owner);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("read_strings", &read_strings, py::arg("data"), py::arg("pos"), py::arg("count"));
  m.def("split_pairs", &split_pairs, py::arg("strings"));
}
