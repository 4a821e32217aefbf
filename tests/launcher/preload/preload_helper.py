# Imported by preload_worker.py from its own directory (sys.path[0] must be the script's directory).
ANSWER = 42
