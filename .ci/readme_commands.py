"""Prints the README's opening commands: the lines of its first fenced code block."""
import sys

lines = open(sys.argv[1], encoding="utf-8").read().splitlines()
start = next(i for i, line in enumerate(lines) if line.startswith("```"))
end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("```"))
for line in lines[start + 1:end]:
    if line.strip():
        print(line.strip())
