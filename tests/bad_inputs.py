"""The bad-input matrix: distinct bad calls of the op, generated per layout, each with the exception
type and a fragment of the message it must raise. ``python tests/bad_inputs.py MODE START`` runs the
cases from START on in one process (MODE pynative: the functional op; graph: a GRAPH_MODE Cell) and
prints one JSON line per case; tests/test_bad_input_matrix.py drives it in subprocesses, so a crash
fails the case instead of killing the run."""
import json
import sys

import numpy as np

LAYOUTS = ("BNSD", "BSND", "BSH", "TND")


def shape(layout, b, n, s, d):
    return {"BNSD": (b, n, s, d), "BSND": (b, s, n, d), "BSH": (b, s, n * d), "TND": (s, n, d)}[layout]


def good(layout):
    """A valid call: 4 query heads over 2 KV heads, 5 queries over 7 keys, head_dim 8."""
    q, k = shape(layout, 1, 4, 5, 8), shape(layout, 1, 2, 7, 8)
    call = {"query": (q, "float32"), "key": (k, "float32"), "value": (k, "float32"), "cos": ((16, 8), "float32"),
            "sin": ((16, 8), "float32"), "attrs": {"input_layout": layout, "head_num": 4}}
    if layout == "TND":
        call["actual_seq_qlen"], call["actual_seq_kvlen"] = [5], [7]
    return call


# TND offsets' values are data: inside a graph the kernel checks them when it launches, and the launch
# fails with a RuntimeError (the kernel's message in cpu_kernel.last_error()).
DATA_DEPENDENT = {"offsets-decreasing", "offsets-q-total", "offsets-kv-total", "offsets-q-over-kv", "offsets-count",
                  "offsets-table"}


def cases():
    """(id, call, exception name, message fragment) for every bad input."""
    out = []

    def add(name, layout, edit, error, message):
        call = good(layout)
        edit(call)
        out.append((f"{layout}-{name}", call, error, message))

    def set_(key, value):
        return lambda c: c.__setitem__(key, value)

    def attr(key, value):
        return lambda c: c["attrs"].__setitem__(key, value)

    for L in LAYOUTS:
        rank = 3 if L in ("BSH", "TND") else 4
        add("query-rank", L, set_("query", ((4, 5, 8, 1, 1)[:rank + 1], "float32")), "ValueError", "query: expected a rank")
        add("key-rank", L, set_("key", ((2, 7, 8, 1, 1)[:rank - 1], "float32")), "ValueError", "key: expected a rank")
        add("value-shape", L, set_("value", (shape(L, 1, 2, 6, 8), "float32")), "ValueError",
            "value: expected the same shape as key")
        add("gqa-not-multiple", L, lambda c: (c.__setitem__("key", (shape(L, 1, 3, 7, 8), "float32")),
                                               c.__setitem__("value", (shape(L, 1, 3, 7, 8), "float32"))),
            "ValueError", "must be a multiple of them")
        add("zero-query-heads", L, lambda c: (c.__setitem__("query", (shape(L, 1, 0, 5, 8), "float32")),
                                               c["attrs"].__setitem__("head_num", None)) if L != "BSH" else
            c["attrs"].__setitem__("head_num", 0), "ValueError", "head" if L == "BSH" else "query: expected at least one head")
        add("zero-kv-heads", L, lambda c: (c.__setitem__("key", (shape(L, 1, 0, 7, 8), "float32")),
                                            c.__setitem__("value", (shape(L, 1, 0, 7, 8), "float32"))),
            "ValueError", "key:")
        add("query-int32", L, set_("query", (shape(L, 1, 4, 5, 8), "int32")), "TypeError", "query: expected dtype in")
        add("query-float64", L, set_("query", (shape(L, 1, 4, 5, 8), "float64")), "TypeError", "query: expected dtype in")
        add("key-float16", L, lambda c: (c.__setitem__("key", (shape(L, 1, 2, 7, 8), "float16")),
                                          c.__setitem__("value", (shape(L, 1, 2, 7, 8), "float16"))),
            "TypeError", "key: expected the same dtype as query (float32), got float16")
        add("value-bfloat16", L, set_("value", (shape(L, 1, 2, 7, 8), "bfloat16")), "TypeError",
            "value: expected the same dtype as query")
        add("cos-int32", L, set_("cos", ((16, 8), "int32")), "TypeError", "cos: expected a floating dtype")
        add("sin-dtype", L, set_("sin", ((16, 8), "float16")), "TypeError", "sin: expected the same dtype as cos")
        add("cos-rank", L, set_("cos", ((16, 8, 1), "float32")), "ValueError", "cos: expected a rank-2 table")
        add("cos-width", L, lambda c: (c.__setitem__("cos", ((16, 4), "float32")), c.__setitem__("sin", ((16, 4), "float32"))),
            "ValueError", "pass rotary_dim=4 for partial rotary")
        add("sin-shape", L, set_("sin", ((12, 8), "float32")), "ValueError", "sin: expected the same shape as cos")
        add("rotary-dim-odd", L, attr("rotary_dim", 5), "ValueError", "rotary_dim: expected a positive even int")
        add("rotary-dim-large", L, attr("rotary_dim", 10), "ValueError", "rotary_dim: 10 exceeds head_dim 8")
        add("rotary-dim-float", L, attr("rotary_dim", 4.0), "ValueError", "rotary_dim: expected a positive even int")
        add("rotary-mode-2", L, attr("rotary_mode", 2), "ValueError", "rotary_mode: expected one of [0, 1]")
        add("rotary-mode-bool", L, attr("rotary_mode", True), "ValueError", "rotary_mode: expected one of [0, 1]")
        add("scale-negative", L, attr("scale", -1.0), "ValueError", "scale: expected a finite positive float")
        add("scale-inf", L, attr("scale", float("inf")), "ValueError", "scale: expected a finite positive float")
        add("scale-huge", L, attr("scale", 1e39), "ValueError", "float32's normal range")
        add("scale-denormal", L, attr("scale", 1e-40), "ValueError", "float32's normal range")
        add("causal-int", L, attr("causal", 1), "ValueError", "causal: expected a bool, got 1")
        add("head-num-bool", L, attr("head_num", True), "ValueError", "head_num: expected a positive int, got True")
        add("head-num-wrong", L, attr("head_num", 2 if L != "BSH" else 3),
            "ValueError", "head_num: 2 does not match" if L != "BSH" else "not a multiple of head_num=3")
        add("layout-unknown", L, attr("input_layout", "SBH"), "ValueError", "input_layout: expected one of")
        add("flag-lse-str", L, attr("return_softmax_lse", "no"), "TypeError", "return_softmax_lse: expected a bool")
        add("flag-key-rotated-int", L, attr("key_rotated", 1), "TypeError", "key_rotated: expected a bool")
        add("backend-unknown", L, attr("backend", "gpu"), "ValueError", "backend: expected one of")
        add("head-dim-odd", L, lambda c: (c.__setitem__("query", (shape(L, 1, 4, 5, 7), "float32")),
                                           c.__setitem__("key", (shape(L, 1, 2, 7, 7), "float32")),
                                           c.__setitem__("value", (shape(L, 1, 2, 7, 7), "float32")),
                                           c["attrs"].__setitem__("rotary_dim", 6)),
            "ValueError", "head_dim must be even")
        if L != "TND":
            add("batch-mismatch", L, lambda c: (c.__setitem__("key", (shape(L, 2, 2, 7, 8), "float32")),
                                                 c.__setitem__("value", (shape(L, 2, 2, 7, 8), "float32"))),
                "ValueError", "key: batch 2 does not match query's batch 1")
            add("q-longer-than-kv", L, set_("query", (shape(L, 1, 4, 9, 8), "float32")), "ValueError",
                "q_len 9 must be <= kv_len 7")
            add("cos-too-short", L, lambda c: (c.__setitem__("cos", ((4, 8), "float32")), c.__setitem__("sin", ((4, 8), "float32"))),
                "ValueError", "cos: table has 4 positions, kv_len 7 needs at least 7")
            add("offsets-outside-tnd", L, lambda c: (c.__setitem__("actual_seq_qlen", [5]),
                                                      c.__setitem__("actual_seq_kvlen", [7])),
                "ValueError", "only for input_layout='TND'")
    tnd = [("offsets-missing", {"actual_seq_qlen": None, "actual_seq_kvlen": None}, "ValueError", "both required"),
           ("offsets-decreasing", {"actual_seq_qlen": [3, 2], "actual_seq_kvlen": [4, 7]}, "ValueError", "non-decreasing"),
           ("offsets-q-total", {"actual_seq_qlen": [3, 4], "actual_seq_kvlen": [4, 7]}, "ValueError", "token count 5"),
           ("offsets-kv-total", {"actual_seq_qlen": [3, 5], "actual_seq_kvlen": [4, 8]}, "ValueError", "token count 7"),
           ("offsets-q-over-kv", {"actual_seq_qlen": [5, 5], "actual_seq_kvlen": [4, 7]}, "ValueError", "q_len 5 > kv_len 4"),
           ("offsets-count", {"actual_seq_qlen": [3, 5], "actual_seq_kvlen": [7]}, "ValueError", "expected 2 sequences"),
           ("offsets-float", {"actual_seq_qlen": [2.5, 5.0], "actual_seq_kvlen": [4, 7]}, "TypeError", "integer cumulative"),
           ("offsets-bool", {"actual_seq_qlen": [True, 5], "actual_seq_kvlen": [4, 7]}, "TypeError", "integer cumulative"),
           ("offsets-str", {"actual_seq_qlen": "5", "actual_seq_kvlen": [7]}, "TypeError", "actual_seq_qlen"),
           ("offsets-table", {"actual_seq_qlen": [1, 5], "actual_seq_kvlen": [1, 7]}, "ValueError", "needs 6")]
    for name, offsets, error, message in tnd:
        call = good("TND")
        call.update(offsets)
        if name == "offsets-table":
            call["cos"] = call["sin"] = ((5, 8), "float32")
        out.append((f"TND-{name}", call, error, message))
    return out


def tensor(spec):
    import mindspore as ms
    from mindspore import Tensor

    shape_, dtype = spec
    data = np.ones(shape_, np.float64 if dtype == "float64" else np.float32)
    if dtype in ("float32", "float64"):
        return Tensor(data.astype(dtype))
    return Tensor(data).astype({"float16": ms.float16, "bfloat16": ms.bfloat16, "int32": ms.int32}[dtype])


def run(mode, start):
    import mindspore as ms
    from mindspore import Tensor, nn

    import ms_rope_attention as mra

    ms.set_device("CPU")
    ms.set_context(mode=ms.GRAPH_MODE if mode == "graph" else ms.PYNATIVE_MODE)

    class Net(nn.Cell):
        def __init__(self, attrs):
            super().__init__()
            self.attrs = attrs

        def construct(self, q, k, v, cos, sin, aq, akv):
            return mra.rotary_flash_attention(q, k, v, cos, sin, actual_seq_qlen=aq, actual_seq_kvlen=akv,
                                              **self.attrs)

    for index, (case_id, call, error, message) in enumerate(cases()):
        if index < start:
            continue
        print(json.dumps({"index": index, "id": case_id, "started": True}), flush=True)
        args = [tensor(call[name]) for name in ("query", "key", "value", "cos", "sin")]
        offsets = [call.get(name) for name in ("actual_seq_qlen", "actual_seq_kvlen")]
        try:
            if mode == "graph":
                offsets = [Tensor(np.array(o, np.int64)) if isinstance(o, list) and all(
                    isinstance(x, int) and not isinstance(x, bool) for x in o) else o for o in offsets]
                Net(call["attrs"])(*args, *offsets)
            else:
                mra.rotary_flash_attention(*args, actual_seq_qlen=offsets[0], actual_seq_kvlen=offsets[1],
                                           **call["attrs"])
            result = {"raised": None}
        except Exception as exc:  # recorded and judged by the test
            message = str(exc)[:2000]
            if isinstance(exc, RuntimeError) and "AOT kernel" in message:  # a launch the kernel refused
                from ms_rope_attention.cpu_kernel import last_error
                message = f"kernel: {last_error()} | {message}"
            result = {"raised": type(exc).__name__, "message": message}
        print(json.dumps({"index": index, "id": case_id, **result}), flush=True)


if __name__ == "__main__":
    run(sys.argv[1], int(sys.argv[2]))
