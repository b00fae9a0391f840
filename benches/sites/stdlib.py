"""A stdlib-heavy Python workload for the profile's cost on a real interpreter: parse and
compile stdlib modules (ast), round-trip their dumps through json, and scan them with re.
Deterministic; about a second natively."""
import ast, json, os, re, sys

root = os.path.dirname(os.__file__)
names = sorted(n for n in os.listdir(root) if n.endswith(".py"))[: int(sys.argv[1]) if len(sys.argv) > 1 else 40]
words = re.compile(r"\b[A-Za-z_][A-Za-z0-9_]{3,}\b")
total = 0
for name in names:
    with open(os.path.join(root, name), encoding="utf-8") as f:
        src = f.read()
    tree = ast.parse(src)
    compile(tree, name, "exec")
    doc = json.dumps([ast.dump(node) for node in tree.body])
    total += len(json.loads(doc)) + len(set(words.findall(src)))
print(len(names), total)
