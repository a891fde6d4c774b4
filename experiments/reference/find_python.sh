# Sourced by the setup_*_env.sh scripts: find_python MAJOR.MINOR VAR prints the interpreter of
# that version: $VAR when set, else pythonMAJOR.MINOR on PATH, else one that pyenv installed.
find_python() {
  local want="$1" var="$2" p pyenv_root=""
  command -v pyenv >/dev/null 2>&1 && pyenv_root="$(pyenv root)"
  for p in "${!var:-}" "$(command -v "python$want" || true)" ${pyenv_root:+"$pyenv_root"/versions/"$want"*/bin/python"$want"}; do
    if [ -n "$p" ] && "$p" -c "import sys; assert '%d.%d' % sys.version_info[:2] == '$want'" >/dev/null 2>&1; then
      echo "$p"; return 0
    fi
  done
  echo "error: Python $want not found (put python$want on PATH or set $var=/path/to/python$want)" >&2
  return 1
}
