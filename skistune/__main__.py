from skistune.cli import main

main()
