"""Every `cu*` / `nvml*` function libvcuda.so exports has exactly the signature the official
headers declare, in CUDA 12.9 (+ nvml.h API 12) and in CUDA 13.x (+ nvml.h API 13); the CUDA
and NVML structs libvcuda defines have the headers' sizes.

How it works (the C compiler is the judge, not string comparison):

1. Exports: `nm -D --defined-only target/release/libvcuda.so`, functions named `cu*`/`nvml*`.
2. Rust side: every `hooks! { Lib fn name(arg: Type, ...) -> Ret => impl; }` entry (and any
   plain `#[no_mangle] extern "C" fn cu*/nvml*`) in vcuda/lib/src/**.rs is parsed, never
   hard-coded. Each Rust type becomes a C type through RUST_TO_C (below):
   - primitives by the table; `u64`/`i64` may be `unsigned long long` or `unsigned long` (and
     signed likewise): Rust has one 64-bit type where LP64 C has two (`cuuint64_t` is
     `unsigned long`, `CUdeviceptr` `unsigned long long`), and the ABI is the same;
   - `*mut T` is `T *`, `*const T` is `T const *`, `Option<extern "C" fn(..) -> R>` is a
     function pointer;
   - a Rust type alias of a primitive (`CUresult = u32`, `CUdevice = i32`,
     `CUdeviceptr = u64`, `CUdeviceptr_v1 = u32`, ...) is that primitive, so the alias itself is
     checked against the header's type;
   - any other alias (opaque handles: `CUcontext = *mut c_void`, `nvmlDevice_t`, ...; opaque
     pointees: `pub type CUctxCreateParams = c_void;`) and any `#[repr(C)]` struct is the
     header typedef *of the same name* (a struct's layout is checked by
     test_struct_layouts_match_headers). Write e.g.
     `pub type nvmlProcessInfo_v2_t = nvmlProcessInfo_t;` to name the header's exact type.
3. C side: per header set, one C file includes cuda.h (with `-D__CUDA_API_VERSION_INTERNAL`,
   which declares the old `_v1`-era names and the `_ptsz`/`_ptds` ones) and nvml.h (with
   `-DNVML_NO_UNVERSIONED_FUNC_DEFS`, which declares both the plain and the versioned names).
   `gcc -aux-info` lists what the headers declare. For each export the program evaluates
   `__builtin_types_compatible_p(__typeof__(&name), <Rust-derived function pointer type>)`
   (C11 6.7.6.3p15: same parameter count, each parameter and the return type compatible) and,
   to say *which* parameter differs, the same test per parameter and for the return type.
   Enums: GCC makes an enum compatible with `unsigned int` when it has no negative enumerator
   (`int` otherwise), so a Rust `u32` for `CUlimit`, `CUresult`, `CUjit_option *`, ... passes,
   and `i32` for such an enum fails. `void *` is not `CUexecAffinityParam *`: a Rust
   `*mut c_void` where the header has a typed pointer is reported (ABI-equivalent, but not the
   header's signature).
4. A name an export uses that a header set does not declare fails, unless ABSENT documents
   that the function does not exist in that version.
5. Structs: each `#[repr(C)]` struct of vcuda/lib/src/ffi.rs (and any other an export's
   signature mentions) is mirrored in C field by field
   (so the mirror has the Rust layout) and compared with the header's type (sizeof, alignof);
   the `size_of`/`offset_of!` numbers pinned in ffi.rs's unit test are compared with the
   headers' sizeof/offsetof too.

Run after scripts/build-gpusim: the Rust types come from the sources, the export list from the
binary built from them.
"""

import dataclasses
import itertools
import pathlib
import re
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SRC = ROOT / "vcuda" / "lib" / "src"
FFI = SRC / "ffi.rs"
LIBVCUDA = ROOT / "target" / "release" / "libvcuda.so"

# Rust type -> C type(s) it may be (the first is the one shown in messages).
RUST_TO_C = {
    "u8": ["unsigned char"],
    "i8": ["signed char"],
    "u16": ["unsigned short"],
    "i16": ["short"],
    "u32": ["unsigned int"],
    "i32": ["int"],
    "u64": ["unsigned long long", "unsigned long"],
    "i64": ["long long", "long"],
    "usize": ["size_t"],
    "isize": ["ptrdiff_t"],
    "f32": ["float"],
    "f64": ["double"],
    "bool": ["_Bool"],
    "c_void": ["void"],
    "c_char": ["char"],
    "c_schar": ["signed char"],
    "c_uchar": ["unsigned char"],
    "c_short": ["short"],
    "c_ushort": ["unsigned short"],
    "c_int": ["int"],
    "c_uint": ["unsigned int"],
    "c_long": ["long"],
    "c_ulong": ["unsigned long"],
    "c_longlong": ["long long"],
    "c_ulonglong": ["unsigned long long"],
    "c_float": ["float"],
    "c_double": ["double"],
    "size_t": ["size_t"],
    "ssize_t": ["ssize_t"],
}

HEADER_SETS = {
    "cuda12.9+nvml12": "CUDA 12.9 + NVML 12 headers (nvidia-cuda-runtime-cu12, nvidia-nvml-dev-cu12)",
    "cuda13+nvml13": "CUDA 13.x + NVML 13 headers (nvidia-cuda-runtime, nvidia-nvml-dev: nvidia/cu13/include)",
}
DEFINES = ["-D__CUDA_API_VERSION_INTERNAL", "-DNVML_NO_UNVERSIONED_FUNC_DEFS"]

# Exports that a header set does not declare because the function does not exist in that
# version: {header set: {name: why}}. Only for functions genuinely absent from that release
# (the test fails if a listed name is declared after all).
ABSENT = {
    # e.g. "cuFooBar": "added in CUDA 13.0 (cudaTypedefs.h: PFN_cuFooBar_v13000)",
    "cuda12.9+nvml12": {
        "cuCtxSynchronize_v2": "added in CUDA 13.0 (cudaTypedefs.h: PFN_cuCtxSynchronize_v13000)",
        "cuGraphAddNode_v3": "added in CUDA 13.4 (cudaTypedefs.h: PFN_cuGraphAddNode_v13040)",
        "nvmlDeviceGetAccountingStats_v2": "added in NVML 13 (nvml.h API 13: nvmlAccountingStats_v2_t)",
    },
    "cuda13+nvml13": {},
}

# ffi.rs offset_of! field -> the header's member name, where snake_case -> camelCase is wrong.
C_FIELD = {}

C_KEYWORDS = {"union", "struct", "enum", "int", "char", "short", "long", "float", "double", "void", "const",
              "signed", "unsigned", "default", "register", "static", "auto", "extern", "volatile", "case"}


# ---------------------------------------------------------------------------------------------
# Rust sources


def strip_comments(text):
    """Blank out comments (keeping offsets and newlines), leave string and char literals."""
    out = list(text)
    i, n = 0, len(text)

    def blank(a, b):
        for k in range(a, b):
            if out[k] != "\n":
                out[k] = " "

    while i < n:
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            blank(i, j)
            i = j
        elif text.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            blank(i, j)
            i = j
        elif text[i] == "r" and re.match(r'r#*"', text[i:]) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            hashes = re.match(r"r(#*)\"", text[i:]).group(1)
            end = text.find('"' + hashes, i + len(hashes) + 2)
            i = n if end < 0 else end + 1 + len(hashes)
        elif text[i] == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            i = j + 1
        elif text[i] == "'":
            if i + 2 < n and text[i + 2] == "'":
                i += 3
            elif i + 1 < n and text[i + 1] == "\\":
                j = text.find("'", i + 2)
                i = n if j < 0 else j + 1
            else:
                i += 1  # a lifetime
        else:
            i += 1
    return "".join(out)


TOKEN = re.compile(r'\s*(r#[A-Za-z_]\w*|[A-Za-z_]\w*|::|->|=>|"[^"]*"|\d\w*|\S)')


@dataclasses.dataclass
class Tok:
    text: str
    start: int
    end: int


def tokenize(text, start=0, end=None):
    end = len(text) if end is None else end
    toks, pos = [], start
    while pos < end:
        m = TOKEN.match(text, pos, end)
        if not m or not m.group(1):
            break
        toks.append(Tok(m.group(1), m.start(1), m.end(1)))
        pos = m.end()
    return toks


class Parser:
    def __init__(self, toks):
        self.toks, self.i = toks, 0

    def peek(self, k=0):
        return self.toks[self.i + k].text if self.i + k < len(self.toks) else None

    def next(self):
        t = self.toks[self.i]
        self.i += 1
        return t

    def expect(self, text):
        t = self.next()
        if t.text != text:
            raise SyntaxError(f"expected {text!r}, found {t.text!r}")
        return t

    def skip_attribute(self):
        self.expect("#")
        depth = 0
        while True:
            t = self.next().text
            depth += t == "["
            depth -= t == "]"
            if depth == 0:
                return

    def type_(self):
        """A Rust type as a tree: ("ptr", const, T) | ("path", name, [generic args]) |
        ("fn", [T], ret, abi) | ("array", T, len) | ("unit",) | ("never",)."""
        t = self.peek()
        if t == "*":
            self.next()
            q = self.next().text
            if q not in ("mut", "const"):
                raise SyntaxError(f"raw pointer without mut/const: *{q}")
            return ("ptr", q == "const", self.type_())
        if t == "&":
            raise SyntaxError("a reference in an extern \"C\" signature (use a raw pointer)")
        if t == "!":
            self.next()
            return ("never",)
        if t == "(":
            self.next()
            self.expect(")")
            return ("unit",)
        if t == "[":
            self.next()
            elem = self.type_()
            self.expect(";")
            n = self.next().text
            self.expect("]")
            return ("array", elem, n)
        if t in ("unsafe", "extern", "fn"):
            abi = "Rust"
            if self.peek() == "unsafe":
                self.next()
            if self.peek() == "extern":
                self.next()
                abi = self.next().text.strip('"') if self.peek().startswith('"') else "C"
            self.expect("fn")
            self.expect("(")
            params = []
            while self.peek() != ")":
                if self.peek(1) == ":" and self.peek(2) != ":":
                    self.next()
                    self.next()
                params.append(self.type_())
                if self.peek() == ",":
                    self.next()
            self.expect(")")
            ret = ("unit",)
            if self.peek() == "->":
                self.next()
                ret = self.type_()
            return ("fn", params, ret, abi)
        name = self.next().text
        if name == "::":
            name = self.next().text
        while self.peek() == "::":
            self.next()
            name = self.next().text
        args = []
        if self.peek() == "<":
            self.next()
            while self.peek() != ">":
                args.append(self.type_())
                if self.peek() == ",":
                    self.next()
            self.expect(">")
        return ("path", name.removeprefix("r#"), args)


@dataclasses.dataclass
class RustFn:
    name: str
    params: list  # [(name, type tree, source text)]
    ret: tuple
    ret_text: str
    where: str
    cfg: bool = False

    def signature(self):
        ps = ", ".join(f"{n}: {t}" for n, _, t in self.params)
        return f"fn {self.name}({ps}) -> {self.ret_text}"


def balanced(text, open_at):
    """Index just past the bracket closing the one at open_at."""
    pairs = {"{": "}", "(": ")", "[": "]"}
    stack = []
    for i in range(open_at, len(text)):
        c = text[i]
        if c in pairs:
            stack.append(pairs[c])
        elif stack and c == stack[-1]:
            stack.pop()
            if not stack:
                return i + 1
    raise SyntaxError("unbalanced brackets")


def src_text(text, toks):
    return " ".join(text[toks[0].start:toks[-1].end].split()).replace("* ", "*")


def line_of(text, pos):
    return text.count("\n", 0, pos) + 1


def parse_fn_after_name(p, text, name, where, cfg):
    """p is just past the function name; parse `(params) -> Ret`."""
    p.expect("(")
    params = []
    while p.peek() != ")":
        pname = p.next().text.removeprefix("r#")
        p.expect(":")
        s = p.i
        ty = p.type_()
        params.append((pname, ty, src_text(text, p.toks[s:p.i])))
        if p.peek() == ",":
            p.next()
    p.expect(")")
    ret, ret_text = ("unit",), "()"
    if p.peek() == "->":
        p.next()
        s = p.i
        ret = p.type_()
        ret_text = src_text(text, p.toks[s:p.i])
    return RustFn(name, params, ret, ret_text, where, cfg)


def rust_sources():
    files = sorted(SRC.rglob("*.rs"))
    assert files, f"no Rust sources under {SRC}"
    return {f: strip_comments(f.read_text()) for f in files}


def parse_rust_functions(sources):
    """name -> [RustFn] for every hooks! entry and #[no_mangle] extern fn named cu*/nvml*."""
    fns = {}
    for path, text in sources.items():
        rel = path.relative_to(ROOT)
        for m in re.finditer(r"\bhooks!\s*\{", text):
            open_at = m.end() - 1
            close = balanced(text, open_at)
            p = Parser(tokenize(text, open_at + 1, close - 1))
            while p.peek() is not None:
                cfg = False
                while p.peek() == "#":
                    a = p.i
                    p.skip_attribute()
                    cfg |= any(t.text == "cfg" for t in p.toks[a:p.i])
                p.next()  # Cuda / Nvml
                p.expect("fn")
                name_tok = p.next()
                f = parse_fn_after_name(p, text, name_tok.text, f"{rel}:{line_of(text, name_tok.start)}", cfg)
                p.expect("=>")
                while p.next().text != ";":
                    pass
                fns.setdefault(f.name, []).append(f)
        for m in re.finditer(r"#\[\s*(?:unsafe\s*\(\s*)?no_mangle\s*\)?\s*\]", text):
            toks = tokenize(text, m.end(), min(len(text), m.end() + 4000))
            p = Parser(toks)
            while p.peek() == "#":
                p.skip_attribute()
            while p.peek() in ("pub", "unsafe", "extern") or (p.peek() or "").startswith('"') or p.peek() == "(":
                if p.next().text == "pub" and p.peek() == "(":
                    while p.next().text != ")":
                        pass
            if p.peek() != "fn":
                continue
            p.next()
            name_tok = p.next()
            if not re.match(r"(cu|nvml)[A-Z]", name_tok.text):
                continue
            f = parse_fn_after_name(p, text, name_tok.text, f"{rel}:{line_of(text, name_tok.start)}", False)
            fns.setdefault(f.name, []).append(f)
    return fns


@dataclasses.dataclass
class RustTypes:
    aliases: dict  # name -> type tree
    structs: dict  # name -> (repr_c, [(field, type tree)], file)
    enums: dict  # name -> repr int type or "C"
    consts: dict  # name -> int


def parse_rust_types(sources):
    aliases, structs, enums, consts = {}, {}, {}, {}
    for path, text in sources.items():
        for m in re.finditer(r"\btype\s+(\w+)\s*=\s*([^;]+);", text):
            try:
                aliases[m.group(1)] = Parser(tokenize(m.group(2))).type_()
            except (SyntaxError, IndexError):
                pass
        for m in re.finditer(r"\bconst\s+(\w+)\s*:\s*\w+\s*=\s*(\d[\d_]*)\s*;", text):
            consts[m.group(1)] = int(m.group(2).replace("_", ""))
        for m in re.finditer(r"((?:#\[[^\]]*\]\s*)*)(?:pub(?:\([^)]*\))?\s+)?(struct|union|enum)\s+(\w+)\s*\{", text):
            attrs, kind, name = m.groups()
            repr_ = re.search(r"repr\s*\(\s*(\w+)", attrs)
            if kind == "enum":
                enums[name] = repr_.group(1) if repr_ else None
                continue
            repr_c = bool(repr_ and repr_.group(1) == "C") and kind == "struct"
            fields = []
            if repr_c:  # only C structs' fields matter (and only they are sure to parse)
                p = Parser(tokenize(text, m.end(), balanced(text, m.end() - 1) - 1))
                while p.peek() is not None:
                    while p.peek() == "#":
                        p.skip_attribute()
                    if p.peek() == "pub":
                        p.next()
                        if p.peek() == "(":
                            while p.next().text != ")":
                                pass
                    fname = p.next().text.removeprefix("r#")
                    p.expect(":")
                    fields.append((fname, p.type_()))
                    if p.peek() == ",":
                        p.next()
            structs[name] = (repr_c, fields, path)
    return RustTypes(aliases, structs, enums, consts)


def resolves_to_primitive(types, tree, seen=()):
    """The primitive a path (through aliases) stands for, or None. An alias of `c_void` is an
    opaque type (`pub type CUfoo_st = c_void;`), not a primitive."""
    if tree[0] != "path" or tree[2]:
        return None
    name = tree[1]
    if name in RUST_TO_C:
        return None if name == "c_void" and seen else name
    if name in types.aliases and name not in seen:
        return resolves_to_primitive(types, types.aliases[name], seen + (name,))
    if types.enums.get(name) in RUST_TO_C:
        return types.enums[name]
    return None


class CTypes:
    """Rust type trees -> C typedefs (emitted into self.lines)."""

    def __init__(self, types, prefix):
        self.types, self.prefix, self.n = types, prefix, 0
        self.lines = []

    def typedef(self, decl):
        """decl has `@` where the new name goes."""
        self.n += 1
        name = f"{self.prefix}{self.n}"
        self.lines.append("typedef " + decl.replace("@", name) + ";")
        return name

    def sig(self, tree):
        """C types a Rust type of a signature may be: [(typedef name, readable C)]."""
        kind = tree[0]
        if kind == "ptr":
            out = []
            for inner, pretty in self.sig(tree[2]):
                if not tree[1]:
                    pretty = f"{pretty} *"
                elif "*" in pretty or "(" in pretty:
                    pretty = f"{pretty} const *"
                else:
                    pretty = f"const {pretty} *"
                out.append((self.typedef(f"{inner}{' const' if tree[1] else ''} *@"), pretty))
            return out
        if kind == "unit":
            return [(self.typedef("void @"), "void")]
        if kind == "fn":
            if tree[3] != "C":
                raise TypeError(f"function pointer with the {tree[3]!r} ABI, not extern \"C\"")
            ret = self.sig(tree[2])[0]
            params = [self.sig(t)[0] for t in tree[1]]
            plist = ", ".join(t for t, _ in params) or "void"
            pretty = f"{ret[1]} (*)({', '.join(p for _, p in params) or 'void'})"
            return [(self.typedef(f"{ret[0]} (*@)({plist})"), pretty)]
        if kind == "array":
            raise TypeError("an array passed by value")
        if kind == "never":
            raise TypeError("`!`")
        name, args = tree[1], tree[2]
        if name == "Option" and len(args) == 1 and args[0][0] == "fn":
            return self.sig(args[0])  # a nullable function pointer: the same ABI
        if args:
            raise TypeError(f"generic type {name}<..> has no C equivalent")
        prim = resolves_to_primitive(self.types, tree)
        if prim:
            return [(self.typedef(f"{c} @"), c) for c in RUST_TO_C[prim]]
        if name in self.types.aliases or name in self.types.structs or name in self.types.enums:
            if name in self.types.structs and not self.types.structs[name][0]:
                raise TypeError(f"struct {name} is not #[repr(C)]")
            return [(self.typedef(f"{name} @"), name)]  # the header's typedef of that name
        raise TypeError(f"type {name} is neither in RUST_TO_C nor defined in vcuda/lib/src")

    def layout(self, tree, mirrors):
        """One C type with the Rust type's layout (for struct mirrors)."""
        kind = tree[0]
        if kind == "ptr" or kind == "fn":
            return "void *"
        if kind == "array":
            n = tree[2]
            n = int(n.replace("_", ""), 0) if n[0].isdigit() else self.types.consts[n]
            return self.typedef(f"{self.layout(tree[1], mirrors)} @[{n}]")
        if kind == "path":
            name, args = tree[1], tree[2]
            if name == "Option" and args and args[0][0] == "fn":
                return "void *"
            prim = resolves_to_primitive(self.types, tree)
            if prim:
                return RUST_TO_C[prim][0]
            if name in self.types.aliases:
                return self.layout(self.types.aliases[name], mirrors)
            if name in self.types.structs:
                return mirrors(name)
        raise TypeError(f"no C layout for {tree}")


# ---------------------------------------------------------------------------------------------
# headers


def include_dirs(header_set):
    import nvidia  # type: ignore  (namespace package of the header wheels)

    roots = [pathlib.Path(p) for p in nvidia.__path__]
    if header_set == "cuda12.9+nvml12":
        want = [("cuda_runtime/include", "cuda.h"), ("nvml_dev/include", "nvml.h")]
    else:
        want = [("cu13/include", "cuda.h"), ("cu13/include", "nvml.h")]
    dirs = []
    for sub, header in want:
        found = [r / sub for r in roots if (r / sub / header).exists()]
        if not found:
            pytest.fail(f"{header} of {HEADER_SETS[header_set]} is not installed: run scripts/setup-test-deps")
        if found[0] not in dirs:
            dirs.append(found[0])
    return dirs


AUX = re.compile(r"^/\* (?P<file>[^:]+):(?P<line>\d+):\w+ \*/ (?P<decl>.*);$")
DECL = re.compile(r"^(?:extern )?(?P<ret>.*?)\b(?P<name>(?:cu|nvml)\w*) \((?P<params>.*)\)$")


def split_top(s):
    parts, depth, cur = [], 0, ""
    for c in s:
        depth += c in "(["
        depth -= c in ")]"
        if c == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
        else:
            cur += c
    if cur.strip():
        parts.append(cur.strip())
    return parts


@dataclasses.dataclass
class CDecl:
    name: str
    ret: str
    params: list  # C types
    file: str
    line: int
    names: list  # parameter names from the header source (best effort, may be empty)

    def prototype(self):
        names = self.names if len(self.names) == len(self.params) else [""] * len(self.params)
        ps = ", ".join(f"{t}{'' if t.endswith('*') else ' '}{n}".strip() for t, n in zip(self.params, names))
        return f"{self.ret}{'' if self.ret.endswith('*') else ' '}{self.name}({ps or 'void'})"


def header_param_names(file, line):
    try:
        lines = pathlib.Path(file).read_text(errors="replace").splitlines()
    except OSError:
        return []
    text = " ".join(lines[line - 1: line + 40])
    start = text.find("(")
    if start < 0:
        return []
    try:
        inner = text[start + 1: balanced(text, start) - 1]
    except SyntaxError:
        return []
    names = []
    for p in split_top(inner):
        fp = re.search(r"\(\s*\*\s*(\w+)\s*\)", p)
        m = fp or re.search(r"(\w+)\s*(?:\[[^\]]*\])?\s*$", p)
        names.append(m.group(1) if m and len(p.split()) > 1 or fp else "")
    return [] if names == [""] else names


_DECLS = {}


def header_declarations(header_set, tmp):
    """Everything cuda.h and nvml.h declare (cu*/nvml* functions): name -> CDecl."""
    if header_set not in _DECLS:
        _DECLS[header_set] = read_declarations(header_set, tmp)
    return _DECLS[header_set]


def read_declarations(header_set, tmp):
    src = tmp / f"decls-{header_set}.c"
    src.write_text("#include <cuda.h>\n#include <nvml.h>\n")
    aux = tmp / f"decls-{header_set}.aux"
    cmd = ["gcc", "-std=gnu11", *DEFINES, *[f"-I{d}" for d in include_dirs(header_set)],
           "-fsyntax-only", "-aux-info", str(aux), str(src)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    assert p.returncode == 0, f"{' '.join(cmd)}\n{p.stderr}"
    decls = {}
    for line in aux.read_text().splitlines():
        m = AUX.match(line)
        if not m or not m.group("file").endswith(("/cuda.h", "/nvml.h")):
            continue
        d = DECL.match(m.group("decl"))
        if not d:
            continue
        params = split_top(d.group("params"))
        params = [] if params == ["void"] else params
        f, ln = m.group("file"), int(m.group("line"))
        decls[d.group("name")] = CDecl(d.group("name"), d.group("ret").strip(), params, f, ln, header_param_names(f, ln))
    return decls


# ---------------------------------------------------------------------------------------------
# the generated checker program


@dataclasses.dataclass
class Item:
    key: str
    decls: list
    stmts: list


def c_string(s):
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def function_item(rf, decl, types):
    """C checks of one export: prints `F name ok`, `R name ok`, `P name i ok sizes classes`."""
    ct = CTypes(types, f"vt_{rf.name}_")
    params = [ct.sig(t) for _, t, _ in rf.params]
    ret = ct.sig(rf.ret)
    n = rf.name
    # one function pointer type per choice among the Rust types' C candidates (u64, ...)
    fnptrs = []
    for r, *ps in itertools.islice(itertools.product(ret, *params), 256):
        fnptrs.append(ct.typedef(f"{r[0]} (*@)({', '.join(p[0] for p in ps) or 'void'})"))
    decls = [f"#undef {n}", *ct.lines]  # the name itself, not a header macro renaming it
    stmts = []
    whole = " || ".join(f"__builtin_types_compatible_p(__typeof__(&{n}), {t})" for t in fnptrs)
    stmts.append(f'printf("F {n} %d\\n", (int)({whole}));')
    rok = " || ".join(f"__builtin_types_compatible_p({decl.ret}, {t})" for t, _ in ret)
    stmts.append(f'printf("R {n} %d\\n", (int)({rok}));')
    for i, (cands, htype) in enumerate(zip(params, decl.params)):
        ok = " || ".join(f"__builtin_types_compatible_p(void (*)({htype}), void (*)({t}))" for t, _ in cands)
        t0 = cands[0][0]
        stmts.append(
            f'printf("P {n} {i} %d %zu %zu %d %d\\n", (int)({ok}), sizeof({htype}), sizeof({t0}), '
            f"__builtin_classify_type(*({htype} *)0), __builtin_classify_type(*({t0} *)0));"
        )
    return Item(n, decls, stmts), [[p for _, p in c] for c in params], [p for _, p in ret]


def snake_to_camel(s):
    return re.sub(r"_([a-z0-9])", lambda m: m.group(1).upper(), s)


def structs_used(tree, types, found):
    """Names of the #[repr(C)] structs a signature's type mentions (through pointers)."""
    if tree[0] == "ptr":
        structs_used(tree[2], types, found)
    elif tree[0] == "fn":
        for t in [*tree[1], tree[2]]:
            structs_used(t, types, found)
    elif tree[0] == "path":
        for t in tree[2]:
            structs_used(t, types, found)
        if types.structs.get(tree[1], (False,))[0]:
            found.add(tree[1])
        elif tree[1] in types.aliases:
            structs_used(types.aliases[tree[1]], types, found)
    return found


def struct_items(types, pinned, used=()):
    """Mirrors of the #[repr(C)] structs of ffi.rs and of those exports use (prelude), and
    their checks against the headers (items)."""
    ct = CTypes(types, "vm_t")
    done = []

    def mirror(name):
        tag = f"vm_{name}"
        if name not in done:
            repr_c, fields, _ = types.structs[name]
            if not repr_c:
                raise TypeError(f"struct {name} is not #[repr(C)]")
            members = [f"{ct.layout(t, mirror)} {f}{'_' if f in C_KEYWORDS else ''};" for f, t in fields]
            ct.lines.append(f"struct {tag} {{ {' '.join(members)} }};")
            done.append(name)
        return f"struct {tag}"

    items = []
    for name, (repr_c, _, path) in types.structs.items():
        if not repr_c or (path != FFI and name not in used):
            continue
        m = mirror(name)
        items.append(Item(f"struct {name}", [], [
            f'printf("S {name} %zu %zu %zu %zu\\n", sizeof({name}), _Alignof({name}), sizeof({m}), _Alignof({m}));'
        ]))
    for label, (name, field, value) in pinned.items():
        if field is None:
            expr, mexpr = f"sizeof({name})", f"sizeof(struct vm_{name})"
        else:
            cfield = C_FIELD.get((name, field), snake_to_camel(field))
            expr = f"__builtin_offsetof({name}, {cfield})"
            mexpr = f"__builtin_offsetof(struct vm_{name}, {field}{'_' if field in C_KEYWORDS else ''})"
        if name not in done:
            mexpr = "(size_t)-1"
        items.append(Item(label, [], [f'printf("A %s %zu %zu\\n", {c_string(label)}, {expr}, {mexpr});']))
    return ct.lines, items


def build_program(header_set, prelude, items, tmp):
    """Compile and run; items whose lines do not compile are left out and returned with the
    compiler's complaint."""
    failed = {}
    items = list(items)
    while True:
        lines = ["#include <stddef.h>", "#include <stdio.h>", "#include <cuda.h>", "#include <nvml.h>", *prelude]
        owner = {}
        for it in items:
            for d in it.decls:
                lines.append(d)
                owner[len(lines)] = it
        lines.append("int main(void) {")
        lines.append('printf("V %d %d\\n", (int)CUDA_VERSION, (int)NVML_API_VERSION);')
        for it in items:
            for s in it.stmts:
                lines.append(s)
                owner[len(lines)] = it
        lines += ["return 0;", "}"]
        src = tmp / f"abi-{header_set}.c"
        exe = tmp / f"abi-{header_set}"
        src.write_text("\n".join(lines) + "\n")
        cmd = ["gcc", "-std=gnu11", "-w", "-fmax-errors=0", *DEFINES,
               *[f"-I{d}" for d in include_dirs(header_set)], str(src), "-o", str(exe)]
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode == 0:
            break
        bad = {}
        for m in re.finditer(rf"^{re.escape(str(src))}:(\d+):\d+: error: (.*)$", p.stderr, re.M):
            it = owner.get(int(m.group(1)))
            if it is None:
                raise AssertionError(f"the generated checker does not compile:\n{p.stderr}")
            bad.setdefault(it.key, []).append(m.group(2))
        if not bad:
            raise AssertionError(f"the generated checker does not compile:\n{p.stderr}")
        failed.update({k: "; ".join(dict.fromkeys(v)) for k, v in bad.items()})
        items = [it for it in items if it.key not in bad]
    out = subprocess.run([exe], capture_output=True, text=True, check=True).stdout
    return out.splitlines(), failed


CLASS = {1: "integer", 2: "char", 3: "enum", 4: "bool", 5: "pointer", 8: "real", 12: "struct", 13: "union"}


def explain(sizes_classes):
    hs, rs, hc, rc = sizes_classes
    if hs != rs:
        return f"ABI MISMATCH: {hs} bytes in the header, {rs} in Rust"
    if hc == rc == 5:
        return "both are pointers (same ABI) but to different types"
    if {hc, rc} <= {1, 2, 3, 4}:
        return ("same size, but a different integer type (signedness; an enum is compatible with "
                "unsigned int when it has no negative enumerator, else with int)")
    return f"same size, different kind: header {CLASS.get(hc, hc)}, Rust {CLASS.get(rc, rc)}"


def check(header_set, rust_fns, types, pinned, tmp, absent=None, structs=None):
    """Problems (list of messages) and notes for the exports rust_fns against one header set;
    with structs (a set of struct names, maybe empty), also for ffi.rs's and those structs."""
    absent = ABSENT[header_set] if absent is None else absent
    decls = header_declarations(header_set, tmp)
    title = HEADER_SETS[header_set]
    problems, notes, items, meta = [], [], [], {}
    for name, rf in sorted(rust_fns.items()):
        if name not in decls:
            if name in absent:
                notes.append(f"{name}: not in {header_set} ({absent[name]})")
            else:
                problems.append(f"{name} ({rf.where}): not declared by the {title}")
            continue
        if name in absent:
            problems.append(f"{name}: listed in ABSENT[{header_set!r}] but the headers declare it: "
                            f"{decls[name].prototype()}")
        d = decls[name]
        try:
            item, pretty_params, pretty_ret = function_item(rf, d, types)
        except TypeError as e:
            problems.append(f"{name} ({rf.where}): {e}")
            continue
        items.append(item)
        meta[name] = (rf, d, pretty_params, pretty_ret)
    prelude, sitems = [], []
    if structs is not None:
        try:
            prelude, sitems = struct_items(types, pinned, structs)
        except (TypeError, KeyError) as e:
            problems.append(f"a struct of {FFI.relative_to(ROOT)} has a field type this test cannot lay out: {e!r}")
    lines, failed = build_program(header_set, prelude, items + sitems, tmp)
    version = next(line.split()[1:] for line in lines if line.startswith("V "))
    kinds = [line[0] for line in lines]
    counted = [f"{kinds.count(k)} {what}" for k, what in
               (("F", "functions"), ("S", "structs"), ("A", "pinned sizes/offsets")) if kinds.count(k)]
    notes.append(f"{header_set}: compared {', '.join(counted) or 'nothing'} with the compiler")
    results = {}
    for line in lines:
        f = line.split()
        if f[0] in ("F", "R"):
            results[(f[0], f[1])] = f[2] == "1"
        elif f[0] == "P":
            results[("P", f[1], int(f[2]))] = (f[3] == "1", tuple(int(x) for x in f[4:8]))
        elif f[0] == "S":
            hs, ha, ms, ma = map(int, f[2:6])
            if (hs, ha) != (ms, ma):
                problems.append(f"struct {f[1]} ({FFI.relative_to(ROOT)}): the {title} make it {hs} bytes "
                                f"(align {ha}), the Rust definition {ms} bytes (align {ma})")
        elif f[0] == "A":
            label = line[2:].rsplit(" ", 2)[0]
            hv, mv = map(int, line.rsplit(" ", 2)[1:])
            pinned_value = pinned[label][2]
            if hv != pinned_value:
                problems.append(f"{label} (pinned in ffi.rs's test): the {title} give {hv}, ffi.rs pins {pinned_value}")
            if mv != (2**64 - 1) and mv != pinned_value:
                problems.append(f"{label}: ffi.rs pins {pinned_value} but its Rust definition gives {mv}")
    for key, err in failed.items():
        if key in meta:
            rf, d, _, _ = meta.pop(key)
            problems.append(f"{key} ({rf.where}): does not compile against the {title}: {err}\n"
                            f"    header: {d.prototype()}\n    rust:   {rf.signature()}")
        else:
            problems.append(f"{key}: does not compile against the {title}: {err}")
    for name, (rf, d, pparams, pret) in meta.items():
        if results[("F", name)]:
            continue
        why = []
        if len(rf.params) != len(d.params):
            why.append(f"{len(rf.params)} parameters in Rust, {len(d.params)} in the header")
        if not results[("R", name)]:
            why.append(f"return type: Rust `{rf.ret_text}` (C `{' | '.join(pret)}`) is not the header's `{d.ret}`")
        for i in range(min(len(rf.params), len(d.params))):
            ok, sc = results[("P", name, i)]
            if not ok:
                pname, _, ptext = rf.params[i]
                hname = d.names[i] if len(d.names) == len(d.params) else ""
                why.append(f"parameter {i + 1} `{pname}`{f' (header: `{hname}`)' if hname and hname != pname else ''}: "
                           f"Rust `{ptext}` (C `{' | '.join(pparams[i])}`) is not the header's `{d.params[i]}`: "
                           f"{explain(sc)}")
        if not why:
            why.append("the function types are incompatible (see the prototypes)")
        problems.append(f"{name} ({rf.where}) does not match the {title} ({pathlib.Path(d.file).name}:{d.line}):\n"
                        f"    header: {d.prototype()}\n    rust:   {rf.signature()}\n"
                        + "\n".join(f"    - {w}" for w in why))
    return problems, notes, version


# ---------------------------------------------------------------------------------------------
# fixtures and tests


@pytest.fixture(scope="module")
def sources():
    return rust_sources()


@pytest.fixture(scope="module")
def types(sources):
    return parse_rust_types(sources)


@pytest.fixture(scope="module")
def rust_fns(sources):
    return parse_rust_functions(sources)


@pytest.fixture(scope="module")
def exports():
    assert shutil.which("nm") and shutil.which("gcc"), "nm and gcc are required: run scripts/setup-test-deps"
    assert LIBVCUDA.exists(), f"{LIBVCUDA} is missing: run scripts/build-gpusim"
    out = subprocess.run(["nm", "-D", "--defined-only", str(LIBVCUDA)], capture_output=True, text=True, check=True).stdout
    funcs = set()
    for line in out.splitlines():
        f = line.split()
        if len(f) == 3 and f[1] in ("T", "W", "i"):
            funcs.add(f[2].split("@")[0])
    return {s for s in funcs if re.match(r"(cu|nvml)[A-Z]", s)}


@pytest.fixture(scope="module")
def exported_fns(exports, rust_fns):
    missing = sorted(n for n in exports if n not in rust_fns)
    assert not missing, (
        "exported by libvcuda.so but declared in vcuda/lib/src neither by a hooks! entry nor by a "
        f"#[no_mangle] extern \"C\" fn, so their Rust types are unknown: {missing}"
    )
    dup = {n: [f.where for f in fs] for n, fs in rust_fns.items() if len(fs) > 1}
    assert not dup, f"declared more than once: {dup}"
    return {n: rust_fns[n][0] for n in sorted(exports)}


@pytest.fixture(scope="module")
def pinned(sources):
    """ffi.rs's unit-test table: label -> (struct, field or None, value)."""
    text = sources[FFI]
    table = {}
    for s, v in re.findall(r"assert_eq!\(\s*size_of::<(\w+)>\(\)\s*,\s*(\d+)\s*\)", text):
        table[f"sizeof({s})"] = (s, None, int(v))
    for s, fld, v in re.findall(r"assert_eq!\(\s*offset_of!\(\s*(\w+)\s*,\s*(\w+)\s*\)\s*,\s*(\d+)\s*\)", text):
        table[f"offsetof({s}, {fld})"] = (s, fld, int(v))
    assert table, "no size_of/offset_of! asserts found in ffi.rs's unit test"
    return table


def test_exports_are_all_parsed(exports, rust_fns, exported_fns):
    """The export list and the parsed sources agree (a stale build would show here)."""
    assert len(exports) >= 10, sorted(exports)
    not_exported = sorted(n for n, fs in rust_fns.items() if n not in exports and not any(f.cfg for f in fs))
    assert not not_exported, (
        f"declared in vcuda/lib/src but not exported by {LIBVCUDA.relative_to(ROOT)} "
        f"(stale build? run scripts/build-gpusim): {not_exported}"
    )


def check_versions(header_set, version):
    cuda_version, nvml_api = map(int, version)
    if header_set == "cuda12.9+nvml12":
        assert (cuda_version, nvml_api) == (12090, 12), version
    else:
        assert cuda_version // 1000 == 13 and nvml_api == 13, version
    return cuda_version


@pytest.mark.parametrize("header_set", list(HEADER_SETS))
def test_exports_match_header_signatures(header_set, exported_fns, types, pinned, tmp_path):
    problems, notes, version = check(header_set, exported_fns, types, pinned, tmp_path)
    cuda_version = check_versions(header_set, version)
    for n in notes:
        print(n)
    if problems:
        pytest.fail(
            f"{len(problems)} problem(s) with libvcuda.so's {len(exported_fns)} cu*/nvml* exports against the "
            f"{HEADER_SETS[header_set]} (CUDA_VERSION {cuda_version}):\n" + "\n".join(problems),
            pytrace=False,
        )


@pytest.mark.parametrize("header_set", list(HEADER_SETS))
def test_struct_layouts_match_headers(header_set, exported_fns, types, pinned, tmp_path):
    used = set()
    for name, rf in exported_fns.items():
        if name in ABSENT.get(header_set, {}):
            continue  # not in these headers: neither are the structs only it uses
        for t in [rf.ret, *(t for _, t, _ in rf.params)]:
            structs_used(t, types, used)
    problems, notes, version = check(header_set, {}, types, pinned, tmp_path, structs=used)
    cuda_version = check_versions(header_set, version)
    for n in notes:
        print(n)
    if problems:
        pytest.fail(
            f"{len(problems)} struct layout problem(s) against the {HEADER_SETS[header_set]} "
            f"(CUDA_VERSION {cuda_version}):\n" + "\n".join(problems),
            pytrace=False,
        )


def test_absent_allowlist_is_documented():
    for header_set, names in ABSENT.items():
        assert header_set in HEADER_SETS
        for name, why in names.items():
            assert re.match(r"(cu|nvml)\w+$", name) and len(why) > 10, (header_set, name, why)


def test_the_checker_catches_wrong_signatures(types, pinned, tmp_path):
    """The checker itself: wrong Rust signatures are reported, naming the parameter and both
    types; right ones (enum as u32, u64 as cuuint64_t) pass."""

    def fn(src):
        text = "hooks! { Cuda " + src + " => x; }"
        return parse_rust_functions_from_text(text)

    good = {f.name: f for f in map(fn, [
        "fn cuCtxSetLimit(limit: u32, value: usize) -> CUresult",
        "fn cuGetProcAddress(symbol: *const c_char, pfn: *mut *mut c_void, version: c_int, flags: u64) -> CUresult",
        "fn cuMemAlloc(dptr: *mut CUdeviceptr_v1, bytesize: c_uint) -> CUresult",
        "fn cuLaunchHostFunc(s: CUstream, f: Option<unsafe extern \"C\" fn(*mut c_void)>, d: *mut c_void) -> CUresult",
    ])}
    problems, _, _ = check("cuda12.9+nvml12", good, types, pinned, tmp_path)
    assert not problems, "\n".join(problems)

    bad = {f.name: f for f in map(fn, [
        "fn cuMemAlloc_v2(dptr: *mut CUdeviceptr, bytesize: u32) -> CUresult",
        "fn cuMemFree(dptr: CUdeviceptr) -> CUresult",
        "fn cuModuleLoad(module: *mut CUmodule, fname: *mut c_char) -> CUresult",
        "fn cuCtxSetLimit(limit: i32, value: usize) -> CUresult",
        "fn cuCtxCreate_v3(pctx: *mut CUcontext, params: *mut c_void, n: c_int, flags: c_uint, dev: CUdevice) -> CUresult",
        "fn cuInit() -> CUresult",
        "fn nvmlDeviceGetCount_v2(count: *mut u64) -> nvmlReturn_t",
        "fn cuDoesNotExist(x: c_int) -> CUresult",
        "fn cuArrayCreate(h: *mut CUarray, d: *const CUDA_NO_SUCH_TYPE) -> CUresult",
        "fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> i64",
    ])}
    problems, _, _ = check("cuda12.9+nvml12", bad, types, pinned, tmp_path)
    text = "\n".join(problems)
    expect = {
        "cuMemAlloc_v2": "parameter 2 `bytesize`: Rust `u32` (C `unsigned int`) is not the header's `size_t`: ABI MISMATCH: 8 bytes in the header, 4 in Rust",
        "cuMemFree": "parameter 1 `dptr`: Rust `CUdeviceptr` (C `unsigned long long | unsigned long`) is not the header's `CUdeviceptr_v1`: ABI MISMATCH",
        "cuModuleLoad": "parameter 2 `fname`: Rust `*mut c_char` (C `char *`) is not the header's `const char *`: both are pointers",
        "cuCtxSetLimit": "parameter 1 `limit`: Rust `i32` (C `int`) is not the header's `CUlimit`: same size, but a different integer type",
        "cuCtxCreate_v3": "Rust `*mut c_void` (C `void *`) is not the header's `CUexecAffinityParam *`",
        "cuInit": "0 parameters in Rust, 1 in the header",
        "nvmlDeviceGetCount_v2": "Rust `*mut u64` (C `unsigned long long * | unsigned long *`) is not the header's `unsigned int *`: both are pointers",
        "cuDoesNotExist": "cuDoesNotExist (x.rs:1): not declared by the CUDA 12.9",
        "cuArrayCreate": "type CUDA_NO_SUCH_TYPE is neither in RUST_TO_C nor defined in vcuda/lib/src",
        "cuMemGetInfo_v2": "return type: Rust `i64`",
    }
    for name, msg in expect.items():
        assert msg in text, f"{name}: expected {msg!r} in:\n{text}"
    assert len(problems) == len(bad), text

    # a Rust type name the headers do not have: the compiler's complaint, for that export only
    fake = dataclasses.replace(types, aliases={**types.aliases, "CUnoSuchHandle": ("ptr", False, ("path", "c_void", []))})
    handle = {"cuArrayDestroy": fn("fn cuArrayDestroy(a: CUnoSuchHandle) -> CUresult"), **good}
    problems, _, _ = check("cuda12.9+nvml12", handle, fake, pinned, tmp_path)
    assert len(problems) == 1 and "cuArrayDestroy (x.rs:1): does not compile" in problems[0], problems
    assert "CUnoSuchHandle" in problems[0], problems

    # struct layouts: a Rust struct that differs from the header's, and a wrong pinned number
    wrong = dict(types.structs)
    repr_c, fields, path = wrong["CUmemLocation"]
    wrong["CUmemLocation"] = (repr_c, [(fields[0][0], ("path", "u64", []))] + fields[1:], path)
    off = next(k for k, v in pinned.items() if v[1] is not None)
    pins = {**pinned, "sizeof(CUuuid)": ("CUuuid", None, 17), off: (*pinned[off][:2], pinned[off][2] + 1)}
    problems, _, _ = check("cuda12.9+nvml12", {}, dataclasses.replace(types, structs=wrong), pins, tmp_path,
                           structs=set())
    text = "\n".join(problems)
    assert "struct CUmemLocation (vcuda/lib/src/ffi.rs): the CUDA 12.9 + NVML 12 headers (nvidia-cuda-runtime-cu12, nvidia-nvml-dev-cu12) make it 8 bytes (align 4), the Rust definition 16 bytes (align 8)" in text, text
    assert "sizeof(CUuuid) (pinned in ffi.rs's test): the CUDA 12.9 + NVML 12 headers (nvidia-cuda-runtime-cu12, nvidia-nvml-dev-cu12) give 16, ffi.rs pins 17" in text, text
    assert f"{off} (pinned in ffi.rs's test)" in text, text

    # a header-declared name in the ABSENT allowlist is itself a problem
    problems, _, _ = check("cuda12.9+nvml12", {"cuMemAlloc": good["cuMemAlloc"]}, types, pinned, tmp_path,
                           absent={"cuMemAlloc": "pretend it is absent"})
    assert any("listed in ABSENT" in p for p in problems), problems


def parse_rust_functions_from_text(text):
    toks = tokenize(text)
    p = Parser(toks[3:-1])  # inside `hooks! { ... }`
    p.next()
    p.expect("fn")
    name = p.next().text
    return parse_fn_after_name(p, text, name, "x.rs:1", False)


# ---------------------------------------------------------------------------------------------
# every ABI variant of a hooked entry point is hooked

# Variants of an entry point libvcuda hooks that it leaves to the driver on purpose:
# {name: why}. Empty today: every declared variant of a hooked function is hooked.
NOT_HOOKED = {}

VARIANT = re.compile(r"^(?P<base>(?:cu|nvml)[A-Za-z0-9]*?)(?:_v\d+)?(?:_ptsz|_ptds)?$")


def variant_base(name):
    """The entry point an exported name is an ABI variant of: `cuMemAlloc_v2` -> `cuMemAlloc`,
    `cuMemcpyHtoD_v2_ptds` -> `cuMemcpyHtoD`, `nvmlDeviceGetCount_v2` -> `nvmlDeviceGetCount`."""
    m = VARIANT.match(name)
    return m.group("base") if m else name


def unhooked_variants(declared, exports, not_hooked):
    """The names `declared` (by a header set) that are a variant of an entry point libvcuda
    exports a wrapper of, but that it neither exports nor lists in `not_hooked`."""
    hooked = {variant_base(n) for n in exports}
    return sorted(n for n in declared
                  if variant_base(n) in hooked and n not in exports and n not in not_hooked)


@pytest.mark.parametrize("header_set", list(HEADER_SETS))
def test_every_variant_of_a_hooked_entry_point_is_hooked(header_set, exports, tmp_path):
    """A program built against these headers, or cudart of that release asking
    cuGetProcAddress for the version it was built for, may reach any ABI variant the headers
    declare (CUDA 13.0 added `cuCtxSynchronize_v2`, 13.4 `cuGraphAddNode_v3`): each one of an
    entry point libvcuda controls must be a libvcuda wrapper, or the call would pass around
    the quota or the limiter."""
    decls = header_declarations(header_set, tmp_path)
    missing = unhooked_variants(decls, exports, NOT_HOOKED)
    if missing:
        pytest.fail(
            f"the {HEADER_SETS[header_set]} declare {len(missing)} variant(s) of entry points libvcuda "
            "hooks that it does not export: hook each (hooks! in vcuda/lib/src) or list it in NOT_HOOKED "
            "with the reason:\n" + "\n".join(f"{n} ({decls[n].file}:{decls[n].line})" for n in missing),
            pytrace=False,
        )
    listed_but_hooked = sorted(n for n in NOT_HOOKED if n in exports)
    assert not listed_but_hooked, f"NOT_HOOKED lists exported wrappers: {listed_but_hooked}"


def test_the_variant_check_catches_a_missing_variant():
    declared = ["cuCtxSynchronize", "cuCtxSynchronize_v2", "cuMemcpyHtoD_v2_ptds", "cuMemcpyHtoD",
                "cuGraphAddNode", "cuGraphAddNode_v2", "cuGraphAddNode_v3", "cuGraphAddNodeX",
                "nvmlDeviceGetCount", "nvmlDeviceGetCount_v2", "cuDeviceGetName"]
    exports = {"cuCtxSynchronize", "cuGraphAddNode", "cuGraphAddNode_v2", "cuMemcpyHtoD", "nvmlDeviceGetCount_v2"}
    assert unhooked_variants(declared, exports, {}) == [
        "cuCtxSynchronize_v2", "cuGraphAddNode_v3", "cuMemcpyHtoD_v2_ptds", "nvmlDeviceGetCount"]
    assert unhooked_variants(declared, exports, {"cuGraphAddNode_v3": "why"}) == [
        "cuCtxSynchronize_v2", "cuMemcpyHtoD_v2_ptds", "nvmlDeviceGetCount"]
