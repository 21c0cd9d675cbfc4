"""The torch backend (`--backend torch`), the reference: the CPU engine, eager or one compiled
graph a step, in every weight format."""
