# Source from a checkout's root on a machine where the members are not installed (a lent GPU machine):
#
#   source benchmarks/device_env.sh && python3 benchmarks/bench_hf_decode.py --random-model --methods hqekv-2
#
# puts every member's src folder on PYTHONPATH and writes each member's entry points as a minimal dist-info (what
# an install writes) on it too, so kvcore's method registry finds the method packages (without it a script that
# looks a method up by name finds none).
export PYTHONPATH=$(ls -d core/*/src packages/*/src integrations/*/src tools/*/src | tr '\n' ':')${PYTHONPATH:-}
export PYTHONUNBUFFERED=1
KV_DEVICE_META=$(mktemp -d)
python3 - "$KV_DEVICE_META" <<'PY'
import pathlib, sys, tomllib
out = pathlib.Path(sys.argv[1])
for pp in sorted(pathlib.Path(".").glob("*/*/pyproject.toml")):
    project = tomllib.loads(pp.read_text())["project"]
    eps = project.get("entry-points", {})
    d = out / f"{project['name'].replace('-', '_')}-0.0.dev0.dist-info"
    d.mkdir()
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: 0.0.dev0\n")
    (d / "entry_points.txt").write_text("".join(
        f"[{g}]\n" + "".join(f"{k} = {v}\n" for k, v in table.items()) + "\n" for g, table in eps.items()))
PY
export PYTHONPATH=$PYTHONPATH:$KV_DEVICE_META
