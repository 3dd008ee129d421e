# model binding: owned by the model/forward work (see docs/INTERNALS.md)
