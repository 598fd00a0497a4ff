"""JSON text that stays on one line for every reader of lines: the server's stream events and the
commands' --json records.

JSON may hold U+0085, U+2028 and U+2029 raw in a string (a token's text; json.dumps with
ensure_ascii=False writes them so), but str.splitlines ends a line at each, and readers of lines
use it: httpx's aiter_lines, requests' iter_lines(decode_unicode=True), a script's
`out.splitlines()`. Escaped, the text means the same and a line is a record."""

LINE_SEPARATORS = {"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"}


def one_line(json_text: str) -> str:
    """`json_text` with LINE_SEPARATORS escaped."""
    # (every stream chunk passes here: three scans in C, and the rare replace, cost far less than str.translate)
    if json_text.isascii() or not ("\x85" in json_text or "\u2028" in json_text or "\u2029" in json_text):
        return json_text
    for c, escaped in LINE_SEPARATORS.items():
        json_text = json_text.replace(c, escaped)
    return json_text
