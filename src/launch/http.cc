// PLACEHOLDER until written.
