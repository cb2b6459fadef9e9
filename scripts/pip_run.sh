# Sourced by scripts/setup.sh and scripts/setup_vllm.sh once they have set PIP (the pip
# command of their environment): `pip_run ARGS` runs "${PIP[@]}" ARGS.
# Where pip's configuration names an extra index of local folders (file://...) that lacks a
# folder for some packages, pip warns once per such package ("Location ... is ignored: it is
# neither a file nor a directory"): hundreds of lines that say nothing about this install and
# bury the rest of a CI log. That one warning is dropped; everything else pip says is kept.
PIP_NOISE="^WARNING: Location 'file://[^']*' is ignored: it is neither a file nor a directory\.$"
pip_run() {
  "${PIP[@]}" "$@" 2> >(grep -v "$PIP_NOISE" >&2)
}
