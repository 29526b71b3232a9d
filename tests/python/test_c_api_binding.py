"""Guards the ctypes binding (python/mok/_lib.py) against drift from the C API (include/mok/c_api.h).

CPU only, no libmok.so, no torch. The header is parsed here and compared, both ways, with what _lib.py
declares: every function _lib._declare binds is in the header with the same argument count, argument
types and return type, and every header function is bound (or in UNBOUND, with a reason); every header
struct has a ctypes.Structure (``mok_layer_shape_t`` -> ``LayerShapeC``) and back, with the same field
names in the same order, field types, offsets, size and alignment (x86-64 System V, computed from the
header); ``#define MOK_X n`` equals ``_lib.X`` and mok_status_t's ``MOK_X = n`` equals ``errors.X``.
Types compare by kind, size and signedness (``c_int`` = ``c_int32`` = int32_t = an enum); any pointer
may be ``c_void_p``, ``T*`` may be ``POINTER(T)``, ``char*`` must be ``c_char_p``. Negative controls
mutate the header (and a Python signature) and check that the comparison reports it.
"""

from __future__ import annotations

import ctypes
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from mok import _lib, errors

HEADER = Path(__file__).resolve().parents[2] / "include" / "mok" / "c_api.h"

# Header functions python/mok does not bind. Keep it short; the test fails when an entry gets bound
# or leaves the header, so that the list shrinks with the binding.
UNBOUND: dict[str, str] = {}  # header functions deliberately left out of _lib.py, with the reason

_PRIMS = {f"{u}int{8 * n}_t": ("int", n, not u) for u in ("", "u") for n in (1, 2, 4, 8)}
_PRIMS.update({"int": ("int", 4, True), "size_t": ("int", 8, False), "float": ("float", 4), "double": ("float", 8),
               "char": ("char",), "void": ("void",)})
_VOIDP = ("voidp",)  # c_void_p: stands for any C pointer


def _declarator(text: str, named: bool = True):
    """'const void **p' -> ('void', 2, 'p'): base type (const dropped), pointer depth, name."""
    tokens = re.findall(r"[A-Za-z_]\w*|\*|\S", text)
    words = [t for t in tokens if t not in ("*", "const")]
    name = words.pop() if words and (named or len(words) > 1 + (words[:1] == ["struct"])) else None
    if not words or any(not re.fullmatch(r"\w+|\*", t) for t in tokens):
        raise ValueError(f"c_api.h: cannot parse {text!r} (arrays, function pointers: not supported)")
    return " ".join(words), tokens.count("*"), name


def _split(text: str, sep: str) -> list[str]:
    """Splits on sep outside { } (one level: c_api.h nests no braces once extern "C" is gone)."""
    return [p.strip() for p in re.split(re.escape(sep) + r"(?![^{]*\})", text) if p.strip()]


def parse_header(text: str) -> SimpleNamespace:
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*", " ", text)
    text = re.sub(r"#ifdef __cplusplus.*?#endif", " ", text, flags=re.S)  # extern "C" { ... }
    h = SimpleNamespace(defines={}, enums={}, structs={}, aliases={}, functions={})
    for name, value in re.findall(r"^\s*#\s*define\s+(\w+)\s+(-?\d+)\s*$", text, flags=re.M):
        h.defines[name] = int(value)
    text = re.sub(r"^\s*#[^\n]*", " ", text, flags=re.M)
    for decl in _split(" ".join(text.split()), ";"):
        if m := re.fullmatch(r"typedef enum\s*\{(.*)\}\s*(\w+)", decl):
            members, value = {}, -1
            for item in _split(m[1], ","):
                key, _, val = item.partition("=")
                value = int(val, 0) if val.strip() else value + 1
                members[key.strip()] = value
            h.enums[m[2]] = members
        elif m := re.fullmatch(r"typedef struct\s*\{(.*)\}\s*(\w+)", decl):
            fields = []
            for member in _split(m[1], ";"):  # int64_t a, b;  const void *p, *q;
                first, *more = _split(member, ",")
                base = _declarator(first)[0]
                fields += [(n, (b, k)) for b, k, n in map(_declarator, [first] + [f"{base} {d}" for d in more])]
            h.structs[m[2]] = fields
        elif decl.startswith("typedef "):
            base, depth, name = _declarator(decl[len("typedef "):])
            h.aliases[name] = (base, depth)
        elif m := re.fullmatch(r"(.*?[\s*])(\w+)\s*\((.*)\)", decl):
            params = [] if m[3].strip() in ("", "void") else _split(m[3], ",")
            args = [_declarator(p, named=False) for p in params]  # (base, depth, name or None)
            h.functions[m[2]] = (_declarator(m[1] + " f")[:2], args)
        else:
            raise ValueError(f"c_api.h: unrecognised declaration {decl!r}")
    return h


def c_kind(h, ctype):
    """(base, depth) -> ('int', 4, True) / ('ptr', ...) / ('struct', name) / ('opaque', tag) ..."""
    base, depth = ctype[:2]
    if base in _PRIMS:
        kind = _PRIMS[base]
    elif base in h.enums:
        kind = ("int", 4, True)  # System V: an enum of small non-negative values is an int
    elif base in h.structs:
        kind = ("struct", base)
    elif base in h.aliases:
        kind = c_kind(h, h.aliases[base])
    elif base.startswith("struct "):
        kind = ("opaque", base)
    else:
        raise ValueError(f"c_api.h: unknown type {base!r}")
    for _ in range(depth):
        kind = ("ptr", kind)
    return kind


def c_str(ctype) -> str:
    return ctype[0] + "*" * ctype[1]


def c_layout(h, kind):
    """(size, alignment) of a C type, x86-64 System V; a struct also gives its field offsets."""
    if kind[0] != "struct":
        size = 8 if kind[0] == "ptr" else kind[1] if len(kind) > 1 else 1  # char: 1
        return size, size, None
    offset, align, offsets = 0, 1, []
    for _, ctype in h.structs[kind[1]]:
        size, a, _ = c_layout(h, c_kind(h, ctype))
        offset = (offset + a - 1) // a * a
        offsets.append(offset)
        offset, align = offset + size, max(align, a)
    return (offset + align - 1) // align * align, align, offsets


def struct_class_name(c_name: str) -> str:
    """mok_layer_shape_t -> LayerShapeC (_lib.py's naming)."""
    return "".join(w.capitalize() for w in c_name.removeprefix("mok_").removesuffix("_t").split("_")) + "C"


def py_declarations():
    """{name: (argtypes, restype)} exactly as _lib._declare sets them, on a stand-in for the CDLL."""
    class Recorder:
        def __getattr__(self, name):
            fn = SimpleNamespace(argtypes=None, restype=ctypes.c_int)  # a CDLL function's defaults
            setattr(self, name, fn)
            return fn

    rec = Recorder()
    _lib._declare(rec, "<test>")
    return {name: (fn.argtypes, fn.restype) for name, fn in vars(rec).items()}


def py_structs():
    return {n: c for n, c in vars(_lib).items()
            if isinstance(c, type) and issubclass(c, ctypes.Structure) and c.__module__ == _lib.__name__}


def py_kind(t):
    special = {None: ("void",), ctypes.c_void_p: _VOIDP, ctypes.c_char_p: ("ptr", ("char",))}
    if t in special:
        return special[t]
    if isinstance(t, type) and issubclass(t, ctypes._Pointer):
        return ("ptr", py_kind(t._type_))
    if isinstance(t, type) and issubclass(t, ctypes.Structure):
        return ("struct", t)
    code = getattr(t, "_type_", None)
    if code in ("f", "d", "g"):
        return ("float", ctypes.sizeof(t))
    if code == "c":
        return ("char",)
    if isinstance(code, str) and code in "bBhHiIlLqQ":
        return ("int", ctypes.sizeof(t), code.islower())
    return ("unsupported", t)


def py_str(t) -> str:
    if t is None:
        return "None"
    if isinstance(t, type) and issubclass(t, ctypes._Pointer):
        return f"POINTER({py_str(t._type_)})"
    return t.__name__ if issubclass(t, ctypes.Structure) else f"ctypes.{t.__name__} ({ctypes.sizeof(t)} bytes)"


def same(c, py, classes) -> bool:
    if py == _VOIDP:
        return c[0] == "ptr" and c[1] != ("char",)  # any pointer but a string
    if c[0] == "ptr" and py[0] == "ptr":
        return same(c[1], py[1], classes)
    if c[0] == "struct" and py[0] == "struct":
        return classes.get(struct_class_name(c[1])) is py[1]
    return c == py and c[0] in ("int", "float", "char", "void")


def binding_problems(header_text: str, funcs=None, classes=None) -> list[str]:
    h = parse_header(header_text)
    funcs = py_declarations() if funcs is None else funcs
    classes = py_structs() if classes is None else classes
    out = []
    for name, (argtypes, restype) in funcs.items():
        if name not in h.functions:
            out.append(f"{name}: declared in _lib.py, not in c_api.h")
            continue
        c_ret, c_args = h.functions[name]
        if argtypes is None:
            out.append(f"{name}: _lib.py sets no argtypes (C: {len(c_args)} arguments)")
            continue
        if not same(c_kind(h, c_ret), py_kind(restype), classes):
            out.append(f"{name}: returns C {c_str(c_ret)}, Python {py_str(restype)}")
        if len(argtypes) != len(c_args):
            out.append(f"{name}: C takes {len(c_args)} arguments ({', '.join(map(c_str, c_args))}), "
                       f"Python {len(argtypes)} ({', '.join(map(py_str, argtypes))})")
            continue
        for i, (ca, pa) in enumerate(zip(c_args, argtypes)):
            if not same(c_kind(h, ca), py_kind(pa), classes):
                out.append(f"{name}: argument {i} ({ca[2] or 'unnamed'}): C {c_str(ca)}, Python {py_str(pa)}")
    for name in h.functions:
        if name not in funcs and name not in UNBOUND:
            out.append(f"{name}: in c_api.h, not bound in _lib.py (_SIGNATURES) nor listed in UNBOUND")
    for name in UNBOUND:
        if name in funcs or name not in h.functions:
            out.append(f"{name}: listed in UNBOUND but {'bound' if name in funcs else 'not in c_api.h'}: drop it")

    expected = {struct_class_name(n): n for n in h.structs}
    out += [f"{cls}: ctypes.Structure in _lib.py without a c_api.h struct" for cls in classes if cls not in expected]
    for cls_name, c_name in expected.items():
        cls = classes.get(cls_name)
        if cls is None:
            out.append(f"{c_name}: in c_api.h, no ctypes.Structure {cls_name} in _lib.py")
            continue
        c_fields, py_fields = h.structs[c_name], list(cls._fields_)
        if [f[0] for f in c_fields] != [f[0] for f in py_fields]:
            out.append(f"{c_name} / {cls_name}: fields differ: C {[f[0] for f in c_fields]}, "
                       f"Python {[f[0] for f in py_fields]}")
            continue
        size, align, offsets = c_layout(h, ("struct", c_name))
        for (field, ctype), (_, ptype), off in zip(c_fields, py_fields, offsets):
            if not same(c_kind(h, ctype), py_kind(ptype), classes):
                out.append(f"{c_name}.{field}: C {c_str(ctype)}, Python {py_str(ptype)}")
            if getattr(cls, field).offset != off:
                out.append(f"{c_name}.{field}: offset C {off}, Python {getattr(cls, field).offset}")
        if (ctypes.sizeof(cls), ctypes.alignment(cls)) != (size, align):
            out.append(f"{c_name}: size/alignment C {size}/{align}, Python {cls_name} "
                       f"{ctypes.sizeof(cls)}/{ctypes.alignment(cls)}")

    for name, value in h.defines.items():
        if name.startswith("MOK_") and getattr(_lib, name[4:], None) != value:
            out.append(f"#define {name} {value}: _lib.{name[4:]} is {getattr(_lib, name[4:], 'missing')}")
    for name, value in h.enums.get("mok_status_t", {}).items():
        if getattr(errors, name[4:], None) != value:
            out.append(f"mok_status_t {name} = {value}: errors.{name[4:]} is {getattr(errors, name[4:], 'missing')}")
    return out


def test_header_parses_to_a_plausible_api():
    h = parse_header(HEADER.read_text())
    assert len(h.functions) > 10 and len(h.structs) >= 4, (sorted(h.functions), sorted(h.structs))
    assert h.enums["mok_status_t"]["MOK_OK"] == 0 and "mok_config_t" in h.structs
    assert c_kind(h, h.functions["mok_workspace_destroy"][1][0]) == ("ptr", ("opaque", "struct mok_workspace"))
    assert len(h.functions["mok_backward"][1]) == 11  # a prototype over three lines
    assert len(py_declarations()) > 10 and len(py_structs()) >= 4


def test_binding_matches_c_api():
    problems = binding_problems(HEADER.read_text())
    assert not problems, "python/mok/_lib.py and include/mok/c_api.h differ:\n  " + "\n  ".join(problems)


@pytest.mark.parametrize("old, new, expected", [
    ("double wait_timeout_s;", "double wait_timeout_s; int32_t extra;", "mok_config_t / ConfigC: fields differ"),
    ("int64_t minibatch, macrobatch;", "uint64_t minibatch, macrobatch;", "mok_config_t.minibatch: C uint64_t"),
    ("int32_t topk, ep;", "int64_t topk, ep;", "mok_layer_shape_t.topk: C int64_t"),
    ("int64_t tokens, mok_stream_t", "int32_t tokens, mok_stream_t", "mok_schedule: argument 2 (tokens): C int32_t"),
    ("mok_status_t mok_workspace_check(mok_workspace_t ws);", "", "mok_workspace_check: declared in _lib.py, not"),
    ("int32_t* runtime, int32_t* headers);", "int32_t* runtime, int32_t* headers, int32_t* more);",
     "mok_nccl_versions: C takes 3"),
    ("const char* mok_version(void);", "const char* mok_version(void); int32_t mok_new(void);", "mok_new: in c_api.h"),
    ("const char* mok_version(void);", "int32_t mok_version(void);", "mok_version: returns C int32_t"),
    ("const mok_config_t* config);", "const mok_layer_shape_t* config);",
     "mok_validate: argument 1 (config): C mok_layer_shape_t*"),
    ("int32_t* gpu_backward,", "uint32_t* gpu_backward,", "mok_engine_info: argument 2 (gpu_backward): C uint32_t*"),
    ("MOK_TIMEOUT = 6", "MOK_TIMEOUT = 9", "MOK_TIMEOUT = 9"),
])
def test_header_change_is_reported(old, new, expected):
    text = HEADER.read_text()
    assert old in text, f"negative control out of date: {old!r} is no longer in c_api.h"
    problems = binding_problems(text.replace(old, new, 1))
    assert any(expected in p for p in problems), f"expected a problem containing {expected!r}, got {problems}"


def test_python_change_is_reported():
    funcs = py_declarations()
    args, restype = funcs["mok_schedule"]
    funcs["mok_schedule"] = ([*args[:2], ctypes.c_uint64, *args[3:]], restype)
    problems = binding_problems(HEADER.read_text(), funcs=funcs)
    expected = f"mok_schedule: argument 2 (tokens): C int64_t, Python {py_str(ctypes.c_uint64)}"
    assert expected in problems, problems
