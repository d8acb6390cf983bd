"""How the launcher's values look outside a terminal: HTML for notebooks (`html`), the memory
bars as inline SVG (`svg`) and PNG plots through matplotlib (`plots`, the `plot` extra).

This room sits just above `errors` and knows none of the launcher's types: each value renders
itself by handing rows, numbers and labels down here, so imports still point one way.
"""
