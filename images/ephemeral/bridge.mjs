// The ephemeral container's one way out: 127.0.0.1:8080 → the run's unix socket (clawmux's
// attribution proxy, scoped to the run). Loopback only: nothing else in the container listens.
import net from "node:net";

const socketPath = process.env.CLAWMUX_LLM_SOCKET || "/llm-sock/llm.sock";
const server = net.createServer((client) => {
  const upstream = net.connect(socketPath);
  client.pipe(upstream).pipe(client);
  const close = () => { client.destroy(); upstream.destroy(); };
  client.on("error", close);
  upstream.on("error", close);
  client.on("close", close);
  upstream.on("close", close);
});
server.listen(8080, "127.0.0.1", () => process.stdout.write("ready\n"));
