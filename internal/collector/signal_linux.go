package collector

import (
	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/dataplane/iptables"
	"github.com/proxyaudit/proxyaudit/dataplane/nl"
)

// openSignal opens the change signal of src: nf_tables for iptables-nft
// and nftables mode, IPT_SO_GET_INFO for the legacy backend, none for
// IPVS and Cilium's maps (which have neither a generation nor
// notifications).
func openSignal(src Source, buffer int) (ChangeSignal, error) {
	switch {
	case src.Mode == audit.ModeIPVS, src.Mode == audit.ModeCilium:
		return nil, nil
	case src.Legacy:
		s, err := iptables.OpenLegacySignal()
		if err != nil {
			return nil, err
		}
		return s, nil
	default:
		s, err := nl.OpenGenSignal(buffer)
		if err != nil {
			return nil, err
		}
		return s, nil
	}
}
