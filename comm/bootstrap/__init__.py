"""Who am I and who are my peers: rendezvous, the store and its host, gathers, agreement,
authentication, descriptor limits and topology. Imports comm.core only."""
