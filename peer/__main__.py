from peer.entry import main

main()
