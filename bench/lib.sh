# Shared by the bench scripts (sourced): stopping by PID, free ports, a process's CPU.

# PID: TERM, wait up to 10 s, then KILL; reaps it.
stop_pid() {
  local p="$1"
  [ -n "$p" ] || return 0
  kill -TERM "$p" 2>/dev/null || return 0
  for _ in $(seq 1 100); do kill -0 "$p" 2>/dev/null || { wait "$p" 2>/dev/null || true; return 0; }; sleep 0.1; done
  kill -KILL "$p" 2>/dev/null || true
  wait "$p" 2>/dev/null || true
}

# A free TCP port on 127.0.0.1.
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1]); s.close()'; }

# CPU seconds (user + system) a live process has used; 0 when it is gone.
cpu_of() { awk -v hz="$(getconf CLK_TCK)" '{print ($14 + $15) / hz}' "/proc/$1/stat" 2>/dev/null || echo 0; }
