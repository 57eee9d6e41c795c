#!/usr/bin/env python3
# Usage: cargo doc -p workspace-core --no-deps && python3 tools/api_surface.py target/doc/workspace_core [-v]
"""Counts the public types and functions a crate's root shows in rustdoc: the root's
items and re-exports (structs, enums, traits, type aliases; free functions; constants)
and the inherent methods of its structs and enums plus the methods of its traits."""
import re, sys, os
d = sys.argv[1]
idx = open(os.path.join(d, 'index.html')).read()
dts = re.findall(r'<dt[^>]*>(.*?)</dt>', idx, re.S)
items = set()
for dt in dts:
    for h in re.findall(r'href="([^"]+\.html)"', dt):
        if h.startswith('../') or h.endswith('index.html'):
            continue
        items.add(h)
kind = lambda i: i.split('/')[-1].split('.')[0]
types = sorted(i for i in items if kind(i) in ('struct', 'enum', 'trait', 'type'))
fns = sorted(i for i in items if kind(i) == 'fn')
consts = sorted(i for i in items if kind(i) == 'constant')
methods = 0
for t in types:
    page = open(os.path.join(d, t)).read()
    if kind(t) == 'trait':
        methods += len(set(re.findall(r'id="(?:ty)?method\.([a-z_0-9]+)"', page.split('id="implementors"')[0])))
    else:
        m = re.search(r'id="implementations-list">(.*?)(?:<h2 id="trait-implementations"|<h2 id="synthetic|<h2 id="blanket|$)', page, re.S)
        if m:
            methods += len(set(re.findall(r'id="method\.([a-z_0-9]+)"', m.group(1))))
print(f"types {len(types)}, free functions {len(fns)}, methods {methods}, functions {len(fns) + methods}, constants {len(consts)}")
if '-v' in sys.argv:
    print(' '.join(t.split('/')[-1].split('.')[1] for t in types))
    print(' '.join(t.split('/')[-1].split('.')[1] for t in fns + consts))
