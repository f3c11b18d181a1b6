// The gateway image's HEALTHCHECK: GET /readyz on the gateway's own loopback port
// (OPENCLAW_GATEWAY_PORT, which the gateway itself listens on). Node's fetch: no curl in the image.
const port = Number.parseInt(process.env.OPENCLAW_GATEWAY_PORT ?? "18789", 10);
const ctl = new AbortController();
const timer = setTimeout(() => ctl.abort(), 4000);
try {
  const res = await fetch(`http://127.0.0.1:${port}/readyz`, { signal: ctl.signal });
  const body = await res.text();
  if (!res.ok) {
    console.error(`gateway not ready: HTTP ${res.status} ${body.slice(0, 200)}`);
    process.exit(1);
  }
  process.exit(0);
} catch (e) {
  console.error(`gateway not ready: ${e?.message ?? e}`);
  process.exit(1);
} finally {
  clearTimeout(timer);
}
