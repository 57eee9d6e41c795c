#!/usr/bin/env python3
# Usage: python3 tools/imports.py DIR [--json] [-v]     (DIR: a crate's src, or a folder under it such as src/nn)
"""Maps the module import graph of the Rust files under DIR.

Every `crate::`, `super::` and `self::` path is read, in `use` declarations (grouped ones
included: `use crate::{a::X, b::{c, d::Y}}`, and 2018 paths that start at a child module)
and in code (`crate::x::Y::new()`); comments and string literals are skipped. A path is
resolved to the module that defines its item: the longest prefix of it that names a
module (a file, or an inline `mod x { .. }` inside one), following the `use` imports of
that module (`pub use` re-exports and a parent's imports reached by `super::`) to the
module where the item is declared. Inline modules count as their file.

The figures printed:
- files: the .rs files under DIR, with DIR's own module file (DIR.rs or DIR/mod.rs).
- arrows: pairs (file, another file of the crate it imports from), from the files under
  DIR. A module's imports of its own descendants are not arrows (declaring a child
  already ties the two), nor are imports of itself. "leaving" counts those whose target
  lies outside DIR.
- arrows up: arrows to a module in a parent folder: the target's folder is a strict
  ancestor of the importing file's folder, where a module's folder is the one its file
  sits in under the 2018 layout (`a/b.rs` and `a/b/mod.rs`: `a`; `lib.rs`: the crate
  root's). An import of a module beside the file, or in a folder below, is not up.
- circles: sets of files that import each other in a circle (strongly connected
  components of more than one file, over the whole crate's arrows) that hold a file
  under DIR; a file outside DIR in one is marked `(outside)`.

-v lists every arrow (`^` marks an arrow up); --json prints all of it as one object.
"""
import json, os, re, sys

args = [a for a in sys.argv[1:] if not a.startswith('-')]
if len(args) != 1:
    sys.exit(__doc__)
DIR = os.path.abspath(args[0])
root = DIR
while not os.path.exists(os.path.join(root, 'lib.rs')) and not os.path.exists(os.path.join(root, 'main.rs')):
    if os.path.dirname(root) == root:
        sys.exit(f'no lib.rs or main.rs in {args[0]} or above it')
    root = os.path.dirname(root)
root_file = 'lib.rs' if os.path.exists(os.path.join(root, 'lib.rs')) else 'main.rs'

def module_of(rel):
    """Module path of a file relative to the crate root: a/b.rs and a/b/mod.rs are ('a', 'b')."""
    if rel == root_file:
        return ()
    parts = rel[:-3].split('/')
    return tuple(parts[:-1] if parts[-1] == 'mod' else parts)

files = {}  # module path -> file (relative to the crate root)
for d, subdirs, names in os.walk(root):
    subdirs[:] = sorted(s for s in subdirs if not (d == root and s == 'bin'))
    for n in sorted(names):
        rel = os.path.relpath(os.path.join(d, n), root).replace(os.sep, '/')
        if n.endswith('.rs') and rel not in ('lib.rs', 'main.rs') or rel == root_file:
            files[module_of(rel)] = rel

TOKEN = re.compile(r'//[^\n]*|/\*.*?\*/|b?r(#*)".*?"\1|b?"(?:\\.|[^"\\])*"|b?\'(?:\\[^\']*|[^\'\\])\'', re.S)
def strip(text):
    """The text with comments and string and character literals blanked."""
    return TOKEN.sub(lambda m: re.sub(r'[^\n]', ' ', m.group(0)), text)

def use_paths(tree):
    """(path, name) pairs of a use tree: 'a::{b, c::D as E, self}' -> (['a','b'],'b'), (['a','c','D'],'E'), (['a'],'a')."""
    toks = re.findall(r'::|[{},*]|\w+', tree)
    out, pos = [], 0
    def parse(prefix):
        nonlocal pos
        path = list(prefix)
        while pos < len(toks):
            t = toks[pos]
            if t == '{':
                pos += 1
                while pos < len(toks) and toks[pos] != '}':
                    parse(path)
                    if pos < len(toks) and toks[pos] == ',':
                        pos += 1
                pos += 1
                return
            if t in (',', '}'):
                break
            pos += 1
            if t == 'as':
                out.append((path, toks[pos])); pos += 1
                return
            if t == '*':
                out.append((path, None))
                return
            if t != '::':
                path = path if t == 'self' and path else path + [t]
        if path:
            out.append((path, path[-1]))
    parse([])
    return out

modules = dict(files)  # module path (inline ones too) -> file
imports = {}  # module path -> {name: absolute path}
refs = []  # (file, module path it sits in, raw path)
for mod, rel in files.items():
    text = strip(open(os.path.join(root, rel), encoding='utf-8').read())
    spans = []  # inline modules: (start, end, path)
    for m in re.finditer(r'\bmod\s+(\w+)\s*\{', text):
        depth, i = 1, m.end()
        while depth and i < len(text):
            depth += {'{': 1, '}': -1}.get(text[i], 0)
            i += 1
        spans.append((m.start(), i, m.group(1)))
    def module_at(pos, mod=mod):
        return mod + tuple(name for s, e, name in spans if s < pos < e)
    for s, e, name in spans:
        modules[module_at(s) + (name,)] = rel
    for m in re.finditer(r'\buse\s+([^;]+);', text):
        for path, name in use_paths(m.group(1)):
            refs.append((rel, module_at(m.start()), path, name))
    for m in re.finditer(r'(?<![\w:$])(?:crate|super|self)(?:::\w+)+', text):
        refs.append((rel, module_at(m.start()), m.group(0).split('::'), None))

def absolute(here, path):
    """The crate-absolute form of a path written in module `here`, or None for another crate's."""
    if path[0] == 'crate':
        return list(path[1:])
    base = list(here)
    if path[0] == 'self':
        path = path[1:]
    elif path[0] == 'super':
        while path and path[0] == 'super':
            base, path = base[:-1], path[1:]
    elif tuple(here) + (path[0],) not in modules:
        return None
    return base + list(path)

for rel, here, path, name in refs:
    full = absolute(here, path)
    if full is not None and name is not None:
        imports.setdefault(here, {})[name] = full

def resolve(full, hops=0):
    """The module that declares what an absolute path names."""
    i = len(full)
    while tuple(full[:i]) not in modules:
        i -= 1
    mod = tuple(full[:i])
    if i < len(full) and hops < 16 and full[i] in imports.get(mod, {}):
        return resolve(imports[mod][full[i]] + full[i + 1:], hops + 1)
    return mod

edges = set()
for rel, here, path, name in refs:
    full = absolute(here, path)
    if full is None:
        continue
    target = resolve(full)
    src = module_of(rel)
    if target[:len(src)] != src:  # not the file itself nor one of its descendants
        edges.add((rel, modules[target]))

def folder(rel):
    return module_of(rel)[:-1]
def is_up(a, b):
    fa, fb = folder(a), folder(b)
    return len(fb) < len(fa) and fa[:len(fb)] == fb

rel_dir = os.path.relpath(DIR, root).replace(os.sep, '/')
def inside(rel):
    return rel_dir == '.' or rel.startswith(rel_dir + '/') or rel in (rel_dir + '.rs', rel_dir + '/mod.rs')
ours = sorted(f for f in files.values() if inside(f))
arrows = sorted(e for e in edges if inside(e[0]))
up = [e for e in arrows if is_up(*e)]

# Tarjan's strongly connected components over the whole crate.
succ = {f: sorted(b for a, b in edges if a == f) for f in files.values()}
index, low, stack, on, comps = {}, {}, [], set(), []
def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v); on.add(v)
    for w in succ[v]:
        if w not in index:
            visit(w); low[v] = min(low[v], low[w])
        elif w in on:
            low[v] = min(low[v], index[w])
    if low[v] == index[v]:
        comp = []
        while True:
            w = stack.pop(); on.discard(w); comp.append(w)
            if w == v:
                break
        comps.append(sorted(comp))
sys.setrecursionlimit(10000)
for f in sorted(succ):
    if f not in index:
        visit(f)
circles = sorted((c for c in comps if len(c) > 1 and any(inside(f) for f in c)), key=lambda c: (-len(c), c))

if '--json' in sys.argv:
    print(json.dumps({'root': root, 'files': ours, 'arrows': arrows, 'arrows_up': up, 'circles': circles}, indent=1))
    sys.exit()
leaving = sum(1 for a, b in arrows if not inside(b))
print(f'files {len(ours)}, arrows {len(arrows)} ({leaving} leaving {args[0]}), arrows up {len(up)}, circles {len(circles)}')
for c in circles:
    print(f'circle of {len(c)}: ' + ', '.join(f if inside(f) else f + ' (outside)' for f in c))
if '-v' in sys.argv:
    for a, b in arrows:
        print(f'{"^" if is_up(a, b) else " "} {a} -> {b}')
