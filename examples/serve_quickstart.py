"""Serve a model over HTTP and call it with the Python client, in one script.

    python examples/serve_quickstart.py              # bundled SmolLM2-135M-Instruct
    python examples/serve_quickstart.py --model tiny # tiny random Llama (fast smoke run)

The server (uvicorn, 127.0.0.1, a free port, an API key, submitted code
enabled) runs in a background thread here; in real use start it with
``asyncinterp serve --api-key KEY`` and only run the client part.
"""

import socket
import threading
import time

import torch
import uvicorn

from _common import load_model
from asyncinterp.serve import Client, RemoteError, Server
import serve_interventions


def start_server(model, key):
    server = Server(model, api_keys=[key], allow_code=True)
    serve_interventions.register(server)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    uv = uvicorn.Server(uvicorn.Config(server.asgi, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uv.started:
        if time.monotonic() > deadline:
            raise RuntimeError("server did not start")
        time.sleep(0.05)
    return f"http://127.0.0.1:{port}", uv, thread


def session(url, key):
    client = Client(url, api_key=key)
    print("health:", client.health())
    info = client.model_info()
    print(f"model {info['model']}: {len(info['modules'])} modules; interventions: {sorted(info['interventions'])}")
    tok_prompt = "The capital of France is"

    # 1. a registered intervention with typed parameters
    top = client.trace(tok_prompt, "top_k", k=5)
    print("top_k ids:", top["ids"].tolist(), "probs:", [round(p, 3) for p in top["probs"][0].tolist()])

    # 2. read an activation (a real torch tensor comes back)
    h = client.trace(tok_prompt, "read", module="model.layers.1", position=-1)
    print("layers.1 output at the last position:", tuple(h.shape), h.dtype)

    # 3. steer while generating, stream the tokens as they are produced
    direction = torch.randn(h.shape[-1])
    print("steered generation: ", end="", flush=True)
    for event in client.stream_generate("Once upon a time", "steer", module="model.layers.1",
                                        vector=direction, strength=4.0, max_new_tokens=12):
        if event["event"] == "token":
            print(event["text"], end="", flush=True)
    print()

    # 4. your own intervention: an async def, sent as source (the server allows code here)
    async def hidden_entropy(m, layer=0):
        import torch
        h = await m.model.layers[layer].output
        p = h[:, -1].softmax(-1)
        return float(-(p * torch.log(p + 1e-12)).sum())
    print("submitted intervention result:", round(client.trace(tok_prompt, hidden_entropy, layer=1), 4))

    # 5. what the sandbox refuses, before any model work
    async def snoop(m):
        import os
        return os.listdir("/")
    try:
        client.trace(tok_prompt, snoop)
    except RemoteError as exc:
        print(f"refused ({exc.status}): {exc.message}")

    # 6. errors come back with the intervention's own traceback lines
    async def broken(m):
        h = await m.model.layers[0].output
        return h[:, 10_000]
    try:
        client.trace(tok_prompt, broken)
    except RemoteError as exc:
        print(f"remote {exc.type} ({exc.status}): {exc.message}")
        print("\n".join(exc.remote_traceback))
    client.close()


if __name__ == "__main__":
    model = load_model(__doc__.splitlines()[0])
    url, uv, thread = start_server(model, key="demo-key")
    try:
        session(url, "demo-key")
    finally:
        uv.should_exit = True
        thread.join(10)
