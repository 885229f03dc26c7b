"""A small request's latency while a large one is being refused (issue 19's "oversized input").

    .venv/bin/python benchmark/probes/bench_oversize.py [BODY_BYTES, default 3900000] [curl|urllib]

The fake engine behind the real app with the real OPT tokenizer (../shared/opt-assets); a body of BODY_BYTES
(a prompt far longer than the context) is sent by curl, another process, so its JSON encoding does not share
this one's GIL, while this process times 2-token requests. Prints the small requests' idle median and their
worst latency meanwhile, and the ratio. `urllib`: the big body is sent by Python's urllib instead, which sends
no `Expect: 100-continue` and the whole body before reading (curl waits for the server's word on a large body):
over the limit (4 MiB) the server answers 413 and then reads and discards the body, which is what this times.
"""
import shutil, statistics, sys, tempfile, threading, time, pathlib
import httpx
from transformers import AutoTokenizer
from opt_serving.service.app import create_app
from opt_serving.service.testserver import serve_in_thread
from opt_serving.text.fake import fake_generator

A = pathlib.Path(__file__).resolve().parents[3] / 'shared' / 'opt-assets'; d = pathlib.Path(tempfile.mkdtemp())
shutil.copy(A / "gpt2-vocab.json", d / "vocab.json"); shutil.copy(A / "gpt2-merges.txt", d / "merges.txt")
(d / "tokenizer_config.json").write_text('{"tokenizer_class": "GPT2Tokenizer", "bos_token": "</s>", "eos_token": "</s>", "unk_token": "</s>", "pad_token": "<pad>", "add_bos_token": true}')
tok = AutoTokenizer.from_pretrained(str(d))
g = fake_generator(num_slots=4, max_seq_len=2048, max_queue=64, tokenizer=tok)
small = {"prompt": "Hello world", "max_tokens": 2, "temperature": 0}
big = {"prompt": "word " * (int(sys.argv[1] if len(sys.argv) > 1 else 3900000) // 5), "max_tokens": 16}
SENDER = sys.argv[2] if len(sys.argv) > 2 else "curl"
with serve_in_thread(create_app(g)) as url, httpx.Client(timeout=120) as c:
    def lat():
        t = time.perf_counter(); r = c.post(url + "/v1/completions", json=small); assert r.status_code == 200
        return time.perf_counter() - t
    for _ in range(5): lat()
    idle = statistics.median(lat() for _ in range(30))
    res = {}
    import json as _j, subprocess as _sp
    _f = str(d / "big.json"); open(_f, "w").write(_j.dumps(big))
    def send_big():  # another process: the client's own JSON encoding must not share this one's GIL
        t = time.perf_counter()
        if SENDER == "urllib":
            code = ("import sys, urllib.request, urllib.error\n"
                    "r = urllib.request.Request(sys.argv[2], data=open(sys.argv[1], 'rb').read(), "
                    "headers={'Content-Type': 'application/json'})\n"
                    "try: print(urllib.request.urlopen(r, timeout=120).status)\n"
                    "except urllib.error.HTTPError as e: print(e.code)\n"
                    "except OSError as e: print(0, type(e).__name__)")
            out = _sp.run([sys.executable, "-c", code, _f, url + "/v1/completions"], capture_output=True, text=True)
            res.update(status=out.stdout.strip(), s=time.perf_counter() - t)
            return
        out = _sp.run(["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "-H", "Content-Type: application/json",
                       "--data-binary", "@" + _f, url + "/v1/completions"], capture_output=True, text=True)
        res.update(status=int(out.stdout), s=time.perf_counter() - t)
    send_big()  # warm: the first refusal pays for imports
    th = threading.Thread(target=send_big); th.start()
    during = []
    while th.is_alive():
        during.append(lat())
    th.join()
    print(f"body {len(str(big))/1e6:.1f} MB: big answered {res['status']} in {res['s']:.2f} s; small idle median "
          f"{idle*1e3:.1f} ms, during: max {max(during)*1e3:.1f} ms over {len(during)} requests "
          f"({max(during)/idle:.1f}x idle)")
g.close()
