"""The engine: the life cycle that carries out a bound plan, and the parts it is made of."""
