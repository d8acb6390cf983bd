"""How the launcher's values look: HTML for notebooks (`html`), the memory bars as inline SVG
(`svg`), PNG plots through matplotlib (`plots`, the `plot` extra), jobs as terminal text
(`text`: status, list, metrics, durations) and the live line of `submit --wait` (`live`).

This room sits just above `errors` and knows none of the launcher's types: each value renders
itself by handing rows, numbers and labels down here, so imports still point one way.
"""
