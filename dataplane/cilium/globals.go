package cilium

// Globals is where Cilium pins its global maps under the BPF filesystem.
const Globals = "tc/globals"
