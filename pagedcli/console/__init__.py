"""What a person sees and types, below the commands that show it and the server that sends it: the
cache drawn (drawing.py, live_view.py) and as JSON (cache_json.py), and prompts read from files and
standard input (prompts.py)."""
