// The elements of `nft -j`'s maps: keys (addresses, ports, their
// concatenations) and verdicts, read with the scanner in jsonscan.go.

package nftables

// nftElem is a map element: key and verdict.
type nftElem struct {
	key    [][]byte // concat parts, raw JSON values
	target string   // goto/jump target chain
}

// elements reads a map's element list: [key, verdict] pairs whose key is a
// concat, possibly wrapped with a comment as {"elem": {"val": …}}.
func elements(raw []byte, fn func(nftElem) error) error {
	sc := at(raw)
	return sc.array(func(int) error {
		var el nftElem
		if sc.peek() != '[' {
			return sc.skip() // a set element: not a map entry
		}
		err := sc.array(func(i int) error {
			switch i {
			case 0:
				k, err := concat(sc)
				el.key = k
				return err
			case 1:
				t, err := verdictTarget(sc)
				el.target = t
				return err
			}
			return sc.skip()
		})
		if err != nil {
			return err
		}
		return fn(el)
	})
}

// concat reads {"concat": [v, …]} or {"elem": {"val": {"concat": …}}} and
// returns the parts as raw values.
func concat(sc *jscan) ([][]byte, error) {
	var parts [][]byte
	if sc.peek() != '{' {
		return nil, sc.skip()
	}
	err := sc.object(func(k []byte) error {
		switch string(k) {
		case "concat":
			return sc.array(func(int) error {
				v, err := sc.span()
				parts = append(parts, v)
				return err
			})
		case "elem":
			return sc.object(func(k []byte) error {
				if string(k) != "val" {
					return sc.skip()
				}
				p, err := concat(sc)
				parts = p
				return err
			})
		}
		return sc.skip()
	})
	return parts, err
}

// verdictTarget reads {"goto": {"target": …}} or {"jump": …} and returns
// the chain; other verdicts return "".
func verdictTarget(sc *jscan) (string, error) {
	target := ""
	if sc.peek() != '{' {
		return "", sc.skip()
	}
	err := sc.object(func(k []byte) error {
		if string(k) != "goto" && string(k) != "jump" {
			return sc.skip()
		}
		t, err := verdictBody(sc)
		target = t
		return err
	})
	return target, err
}

func jsonString(raw []byte) string {
	v, err := at(raw).str()
	if err != nil {
		return ""
	}
	return string(v)
}

func jsonPort(raw []byte) (uint16, bool) {
	sc := at(raw)
	n, err := sc.int()
	if err != nil || sc.peek() != 0 || n < 0 || n > 65535 {
		return 0, false
	}
	return uint16(n), true
}
